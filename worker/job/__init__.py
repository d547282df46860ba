"""One claimed job, from claim to its one result: the job lifecycle.

    run         JobRun: subscribe, park until start or kill, run, report once
    precompile  loading, or compiling, in a spare sandbox while the job is parked
    supervise   the wall, CPU and idle clocks around one step (compile or run)
    stdin       feeding stored and live stdin frames to the program, in order
    flusher     coalescing output into few events, off the program's critical path
    output      the output budget (limits, truncation, kept bytes)
    events      the job's durable event log, and publishing it once the job is live
    outcome     the verdict table: what facts of a step mean
    batch       test cases, each in a fresh sandbox, judged
    artifacts   files the program left, stored and announced
    payload     fitting a result into one published event

How a jail is built is worker/isolation's business; this package uses its `Sandbox`,
`SandboxPool`, `Jail` and `Program`, and meets the API only through worker/messaging.
"""
