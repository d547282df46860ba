"""Where the worker meets the API and the clients: Redis and soketi.

    queue      claims, leases and every fenced write of a job (Lua scripts on Redis)
    control    one pub/sub connection for every job's ctrl and stdin messages
    publisher  publishing events to soketi, in order per channel, in batches
"""
