# coderunner: a Python runtime started in a warm jail before its job exists.
#
# The worker starts this as the interpreter part of the language's `run` command plus this
# file (e.g. `python3 -u /.coderunner/prestart/python.py`), so the interpreter is loaded
# and `site` imported while the jail waits. The jail is the job's own and serves one job
# only; nothing here is shared. On start the worker sends the frame the gate would have
# had (see worker/isolation/gate.c: argv, environment, rlimits; the worker has already
# applied the rlimits from outside), and this runs the entry file the way `python3 -u
# main.py args...` would: sys.argv, sys.orig_argv, sys.path[0], a fresh __main__ module
# with __file__ absolute, exit status 1 after an uncaught exception, 2 when the file
# cannot be opened, and tracebacks that start at the user's file.
#
# Before start, the only thing written is one ready marker on stderr, which the worker
# reads (and so removes) before the jail is offered to a job; no descriptor is opened, and
# the frame is read from stdin with exact-size reads, so not one byte of the program's own
# input is consumed.


READY = b"\0coderunner-prestart-ready\n"


def _serve():
    import os
    import sys

    def read_exact(n):
        parts = []
        while n:
            chunk = os.read(0, n)
            if not chunk:
                raise SystemExit(0)  # the worker closed the pipe: the job never started
            parts.append(chunk)
            n -= len(chunk)
        return b"".join(parts)

    def u32():
        return int.from_bytes(read_exact(4), "little")

    def strings():
        return [read_exact(u32()) for _ in range(u32())]

    # A process's first compile() costs about a millisecond here, nearly all of it the
    # one-time set-up of the AST node types (compile() checks whether it was given an AST),
    # which `python3 main.py` never pays: the interpreter compiles a script file without that
    # check. The job's compile() below would pay it after start; this pays it now. An empty
    # source is enough (a larger one measured no faster afterwards); no module is created.
    compile("", "<prestart>", "exec", dont_inherit=True)
    # Everything alive now is the runtime's own (the job's __main__ and all it makes come
    # after the frame). Frozen, the cyclic collector never walks it again, and that includes
    # the full collection in the interpreter's shutdown, which took 1.2 to 1.9 ms of every
    # job's end here. Nothing the job makes is frozen, so its finalizers run at exit exactly
    # as under `python3 main.py`. (CPython only: PyPy's gc has no freeze, nor that cost.)
    import gc

    if hasattr(gc, "freeze"):
        gc.freeze()
    os.write(2, READY)  # the worker waits for this before offering the jail to a job
    if read_exact(4) != b"CRG1":
        raise SystemExit(0)
    argv = [os.fsdecode(item) for item in strings()]
    env = [item.split(b"=", 1) for item in strings()]
    read_exact(24)  # rlimits: already set on this process by the worker

    # The environment is the jail's plus the job's, exactly as the gate would leave it.
    for name in os.environ.get("CODERUNNER_PRESTART_ENV", "").split(","):
        os.environ.pop(name, None)
    os.environ.pop("CODERUNNER_PRESTART_ENV", None)
    for name, value in env:
        os.environ[os.fsdecode(name)] = os.fsdecode(value)

    prefix = len(sys.orig_argv) - 1  # the interpreter and its options, as in `run`
    script_argv = argv[prefix:]
    sys.orig_argv = argv
    sys.argv = script_argv
    path = os.path.abspath(script_argv[0])
    sys.path[0] = os.path.dirname(path)
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as exc:
        sys.stderr.write(f"{argv[0]}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}\n")
        raise SystemExit(2) from None

    main = type(sys)("__main__")
    main.__file__ = path
    main.__cached__ = None
    main.__annotations__ = {}
    main.__builtins__ = sys.modules["builtins"]
    main.__loader__ = sys.modules["_frozen_importlib_external"].SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    here = sys._getframe().f_code.co_filename
    del env, argv, f
    try:
        exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == here:
            tb = tb.tb_next
        exc.__traceback__ = tb
        if isinstance(exc, KeyboardInterrupt):
            import signal

            sys.excepthook(type(exc), exc, tb)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        sys.excepthook(type(exc), exc, tb)
        failed = True
    else:
        failed = False
    if failed:
        raise SystemExit(1)


_serve()
