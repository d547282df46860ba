"""HTTP API: validates programs, queues them in Redis, hands out realtime channels."""
