# coderunner: a Python runtime started in a warm jail before its job exists.
#
# The worker starts this as the interpreter part of the language's `run` command plus this
# file (e.g. `python3 -u /.coderunner/prestart/python.py`), so the interpreter is loaded
# and `site` imported while the jail waits. The jail is the job's own and serves one job
# only; nothing here is shared. On start the worker sends the frame the gate would have
# had (see worker/isolation/gate.c: argv, environment, rlimits; the worker has already
# applied the rlimits from outside), and this runs the entry file the way `python3 -u
# main.py args...` would: sys.argv, sys.orig_argv, sys.path[0], a fresh __main__ module
# with __file__ absolute, the user's site-packages if the job brought one, exit status 1
# after an uncaught exception (the interpreter's own shutdown after a KeyboardInterrupt), 2
# when the file cannot be opened, and tracebacks that start at the user's file.
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
    strings()  # environment: the job's is the one this process started with (Prime.adopts)
    read_exact(24)  # rlimits: already set on this process by the worker

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
    if b"\0" in source:
        # The interpreter reads a file with NUL bytes its own way, which compile() does not
        # (versions differ: one cuts each line at the NUL, a later one refuses the file):
        # such a program runs as the plain command itself, this process replaced by it.
        os.execv(argv[0], argv)

    # `site` looked for the user's site-packages (~/.local/..., HOME being the workspace) before
    # the job's files were there; `python3 main.py` finds it if the job brought one. It goes
    # where site would have put it: after the standard library, before the system's folders.
    import site

    user_site = site.getusersitepackages()
    if site.ENABLE_USER_SITE and user_site not in sys.path and os.path.isdir(user_site):
        system = [at for at, entry in enumerate(sys.path) if entry in site.getsitepackages()]
        tail = sys.path[system[0] :] if system else []
        del sys.path[len(sys.path) - len(tail) :]
        site.addsitedir(user_site)
        sys.path.extend(entry for entry in tail if entry not in sys.path)

    main = type(sys)("__main__")
    main.__file__ = path
    main.__cached__ = None
    main.__annotations__ = {}
    main.__builtins__ = sys.modules["builtins"]
    main.__loader__ = sys.modules["_frozen_importlib_external"].SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    del argv, f, site, user_site
    return compile(source, path, "exec", dont_inherit=True), main.__dict__


def _first_call_without(shim, hook):
    """sys.excepthook for the interpreter's report of the uncaught exception: `hook`, called
    with the traceback past the frames of `shim`; it puts `hook` back before anything else."""

    def report(kind, value, tb):
        import sys

        sys.excepthook = hook
        while tb is not None and tb.tb_frame.f_code.co_filename == shim:
            tb = tb.tb_next
        value.__traceback__ = sys.last_traceback = tb
        try:
            hook(kind, value, tb)
        except SystemExit:
            raise  # the interpreter exits with it, as when a plain run's hook raises it
        except BaseException as error:
            # What the interpreter prints when the hook fails, without this function's frame.
            error.__traceback__ = error.__traceback__.tb_next
            sys.stderr.write("Error in sys.excepthook:\n")
            sys.__excepthook__(type(error), error, error.__traceback__)
            sys.stderr.write("\nOriginal exception was:\n")
            sys.__excepthook__(kind, value, tb)

    return report


# The program runs from this module's own frame, not from a function's below it: one frame
# fewer between it and the bottom of the stack (plain, it has none), which is that much more
# of the recursion limit for the program, as in `python3 main.py`. Its globals are held by
# nothing of this module's (which gc.freeze() keeps for good), so they are cleared and their
# objects finalized at exit as in a plain run.
try:
    exec(*_serve())
except SystemExit:
    raise
except BaseException:
    # The exception leaves the way it leaves `python3 main.py`: the interpreter sets sys.last_*,
    # calls sys.excepthook, exits 1, and after an uncaught KeyboardInterrupt joins threads,
    # runs atexit, flushes, and dies of SIGINT. Only its traceback starts in this file: the hook
    # that prints it is wrapped, for that one call, to start at the program's first frame, as
    # it does in a plain run.
    import sys

    if getattr(sys, "excepthook", None) is not None:
        sys.excepthook = _first_call_without(sys._getframe().f_code.co_filename, sys.excepthook)
    raise
