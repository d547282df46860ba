"""Where the worker meets the API and the clients: Redis and soketi.

    queue      claims, leases and every fenced write of a job (Lua scripts on Redis)
    control    one pub/sub connection for every job's ctrl and stdin messages
    flagsweep  the stored start and kill flags of every parked job, read in one trip
    publisher  publishing events to soketi, in order per channel, in batches
"""
