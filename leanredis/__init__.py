"""A Redis client for the hot path: redis-py's interface over one pipelined connection.

See `leanredis.client` for why it exists and what it keeps of redis-py.
"""

from leanredis.client import BlockingLeanRedis, DialError, DialTimeoutError, LeanRedis, NeverSent

__all__ = ["BlockingLeanRedis", "DialError", "DialTimeoutError", "LeanRedis", "NeverSent"]
