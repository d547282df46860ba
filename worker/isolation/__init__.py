"""How a jail is built, kept warm, and taken apart: the isolation mechanics.

    sandbox    a slot's sandbox (workspace + cgroups + a jail parked at its gate), and the
               factory that builds them; the compile jail beside the run jail
    pool       the warm pool: one ready sandbox per slot, taken by whichever job starts
    jail       one nsjail process behind the gate (gate.c), released with one frame
    cgroups    the worker's own cgroup trees (pure v2, or hybrid v1 + v2), limits, kill
    workspace  the per-sandbox tmpfs, filled through O_NOFOLLOW before any job code runs
    mounts     the two mount(2) calls the worker makes on the host
    toolchains read-only binds for toolchains outside folders jails may traverse
    janitor    removing sandboxes of workers that died
    uids       this worker's job uids, locked on the host for its life
    selftest   one real jail at start-up, or a clear refusal
    buildcache what start-up compiles (gate, helpers, shims), kept once per host

The job lifecycle (park, run, clocks, events, result) lives beside it, in worker/job/,
and uses only `SandboxFactory`, `SandboxPool`, `Sandbox`, `Jail` and `Program`.
"""
