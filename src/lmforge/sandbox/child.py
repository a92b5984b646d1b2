"""The program a sandboxed interpreter runs (`python -I -c` this file's text; lmforge.sandbox
starts it). It is not imported by lmforge: it runs in the child, where the candidate lives.

The child OBSERVES; it never judges. It receives what it must run (the candidate's source, the
arguments of each case, the sources of the docstring examples) and never an expected result: it
reports what it saw (the repr of each value returned and of the arguments after the call, the
name of an exception, an example's output) and lmforge's own process compares. Whatever the
candidate does to this process can change what is reported, never the verdict.

argv: the report pipe's fd, the address-space and file-size limits (bytes). The job (JSON, with
the parent's nonce) arrives on stdin. The report is one JSON array a line, each starting with
the nonce, in this order: ["ready", doc] (sent before any candidate code exists: the only
message the parent trusts; or ["error", why] instead), then ["compile", why] or one ["obs", ...]
per case or example, then ["done"]; a probe job sends ["kept", name, args, result, after] lines.
Then the process ends at once (`os._exit`: no atexit, no finalizer, no thread outlives it) and
the parent kills its process group as soon as it has what it needs.

The audit hook is installed before the candidate's source is compiled and stays on for the rest
of the process's life. Its state lives in its defaults (reading a function's `__defaults__` is
itself an audited event it refuses) and it calls only C functions it captured, so a body that
monkeypatches `os.path`, builtins or this module, or reaches a frame, cannot switch it off.
"""


def main():
    # all imported before the limits below (`_prepare` and `_observe` import them again: loaded)
    import ast, builtins, doctest, importlib, io, itertools, json, os, signal, sys  # noqa: F401
    fd = int(sys.argv[1])
    _limits(int(sys.argv[2]), int(sys.argv[3]))
    # everything used after the candidate exists is a local captured now (builtins and C functions)
    write, exit_now = os.write, os._exit
    esc = json.encoder.c_encode_basestring_ascii or json.encoder.encode_basestring_ascii  # C: cannot be patched
    exact, repr_, type_, len_, list_, islice = str.__str__, repr, type, len, list, itertools.islice
    hasattr_, isinstance_, exec_, str_, base = hasattr, isinstance, exec, str, BaseException
    job = json.loads(sys.stdin.buffer.read())
    nonce = job["nonce"]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    most = 1 << 20  # characters of one observed text

    def emit(*parts):
        line = ("[" + ",".join([esc(nonce)] + [esc(p) for p in parts]) + "]\n").encode("utf-8", "surrogatepass")
        while line:
            line = line[write(fd, line):]

    def seen(value):
        text = exact(value)
        return text if len_(text) <= most else text[:most]

    def line(exc):  # the line doctest compares with an example's expected exception (no traceback needed)
        t = type_(exc)
        kind = t.__qualname__ if t.__module__ in ("builtins", "__main__") else f"{t.__module__}.{t.__qualname__}"
        text = exact(str_(exc))
        return f"{kind}: {text}\n" if text else f"{kind}\n"

    # -- trusted: nothing of the candidate's exists yet ------------------------------------------
    kind, name = job["kind"], job.get("function", "")
    try:
        mod, ref, ns, doc, items, stand_in, ref_file = _prepare(job, kind, name, line)
    except BaseException as exc:
        emit("error", f"the harness could not prepare the job ({job.get('module')!r}): {type(exc).__name__}: "
                      f"{str(exc)[:120]}")
        exit_now(0)
    sys.addaudithook(_hook(os.path.realpath(os.getcwd()), os, ref_file))
    emit("ready", doc)

    # -- the candidate's reach starts here: only what it did is reported -----------------------------
    if kind == "probe":  # no candidate: the references themselves, on inputs
        signal.signal(signal.SIGALRM, _expire)
        for fname, inputs in items:
            for args, result, after in _probe(getattr(mod, fname, None), inputs, signal, job["call_s"]):
                emit("kept", fname, args, result, after)
        emit("done")
        exit_now(0)
    # entered before any candidate code exists: no name is looked up here once it does
    _observe(job, kind, name, items, mod, ref, ns, stand_in, emit, seen, line, exit_now,
             (repr_, type_, list_, islice, hasattr_, isinstance_, exec_, base))


def _prepare(job, kind, name, line):
    """The trusted part of `main` (no candidate code exists yet): (mod, ref, ns, doc, items,
    stand_in, ref_file): the reference's module and function, the candidate's namespace, the
    docstring "ready" sends, the job's items by kind, and the reference's stand-in code and file."""
    import ast, builtins, doctest, importlib
    _limits_cpu(job["cpu_s"])
    mod = importlib.import_module(job["module"]) if job["module"] else None
    ref = getattr(mod, name, None) if mod is not None and name else None
    ns = dict(vars(mod)) if mod is not None else {"__name__": "__sandbox__", "__builtins__": builtins}
    doc, items = "", []
    if kind == "doctest":
        sources = job.get("examples")
        if sources is None:  # the reference's own docstring: the parent reads its expected outputs
            doc = getattr(ref, "__doc__", None) or ""
            doc = doc if type(doc) is str else ""
            try:
                sources = [ex.source for ex in doctest.DocTestParser().get_examples(doc)]
            except ValueError:
                sources = []
        for i, text in enumerate(sources):
            try:
                items.append((compile(text, f"<example {i + 1}>", "single"), ""))
            except (SyntaxError, ValueError, OverflowError) as exc:  # the example's own fault: it "raised"
                items.append((None, line(exc)))
    elif kind == "cases":
        items = [ast.literal_eval(a) for a in job["args"]]
    elif kind == "probe":
        items = list(job["probes"].items())
    else:
        raise ValueError(f"unknown job kind {kind!r}")
    # the reference stays reachable under other names (another module's import of it, a
    # default argument): its code becomes a call of the module's `name` (the candidate, soon),
    # and its module's code may not run again (a reload would bring the reference back)
    stand_in, ref_file = None, ""
    if kind != "probe" and type(ref) is type(_expire) and ref.__closure__ is None and name:
        scope = {}
        exec(compile(f"def {name}(*args, **kwargs):\n    return {name}(*args, **kwargs)\n", "<the candidate>",
                     "exec"), scope)
        stand_in, ref_file = scope[name].__code__, ref.__code__.co_filename
    return mod, ref, ns, doc, items, stand_in, ref_file


def _observe(job, kind, name, items, mod, ref, ns, stand_in, emit, seen, line, exit_now, captured):
    """`main` from the candidate's compilation on; ends the process. Called before any candidate
    code exists (its running code cannot be swapped); uses the builtins `main` captured."""
    import ast, io, sys
    repr_, type_, list_, islice, hasattr_, isinstance_, exec_, base = captured
    try:
        tree = ast.parse(job["source"], "<candidate>")
        defs = (ast.FunctionDef, ast.AsyncFunctionDef)
        if len(tree.body) != 1 or not isinstance(tree.body[0], defs) or tree.body[0].name != name:
            raise SyntaxError(f"the candidate must be one definition of {name!r} and nothing else "
                              f"(no statement, definition or decorator after the function)")
        exec(compile(tree, "<candidate>", "exec"), ns)  # runs the def statement only (the signature is ours)
        cand = ns[name]
        if mod is not None:
            setattr(mod, name, cand)  # `from module import name` inside the body is the candidate
            if stand_in is not None:
                ref.__code__ = stand_in  # and so is every other name of the reference
    except base as exc:
        emit("compile", f"{type_(exc).__name__}: {str(exc)[:160]}")
        exit_now(0)
    if kind == "cases":
        for args in items:
            try:
                r = cand(*args)
                if hasattr_(r, "__next__") and not isinstance_(r, (str, bytes)):
                    r = list_(islice(r, 1000))  # a generator compares by what it yields
                obs = ("value", seen(repr_(r)), seen(repr_(args)))
            except MemoryError:
                obs = ("oom",)
            except base as exc:
                try:
                    obs = ("raise", seen(type_(exc).__name__))
                except base:
                    obs = ("raise", "?")
            emit("obs", *obs)
    else:
        out = io.StringIO()
        reset, truncate, value = out.seek, out.truncate, out.getvalue
        sys.stdout = sys.stderr = out
        for code, error in items:
            reset(0)
            truncate()
            if code is None:
                emit("obs", "raise", error)
                continue
            try:
                exec_(code, ns)
                obs = ("out", seen(value()))
            except MemoryError:
                obs = ("oom",)
            except base as exc:
                try:
                    obs = ("raise", seen(line(exc)))
                except base:
                    obs = ("raise", "?")
            emit("obs", *obs)
    emit("done")
    exit_now(0)


def _hook(home, os, ref_file=""):
    """The audit hook: refuses sockets, processes, frames, ... and writes outside `home`, and
    running the code of `ref_file` (the reference's module) again. Its state is in its defaults
    (unreadable: reading __defaults__ is audited and refused), its helpers are C functions; it
    looks up no global or builtin name when it runs. It stays long: the hook must be built here,
    its state bound as defaults when it is defined, and it is one function by design (below)."""
    WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    REFUSED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
               "os.forkpty", "os.kill", "os.killpg", "os.setsid", "os.setns", "os.unshare", "ctypes.", "sys._getframe",
               "sys._current_frames", "sys.settrace", "sys.setprofile", "sys._settraceallthreads",
               "sys._setprofileallthreads", "sys.monitoring", "sys.addaudithook", "gc.get_", "object.__getattr__",
               "pty.", "resource.setrlimit", "resource.prlimit",
               "os.chroot", "shutil.", "os.startfile", "webbrowser.", "sqlite3.", "syslog.", "_thread.start",
               "signal.pthread_kill")
    # events on paths: the positions of their paths, and of their dir_fd arguments (-1: none)
    PATHS = {"os.remove": ((0,), (1,)), "os.rename": ((0, 1), (2, 3)), "os.rmdir": ((0,), (1,)),
             "os.mkdir": ((0,), (2,)), "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)),
             "os.symlink": ((1,), (2,)), "os.link": ((0, 1), (2, 3)), "os.truncate": ((0,), ()),
             "os.utime": ((0,), (3,)), "os.chflags": ((0,), ()), "os.lchflags": ((0,), ()),
             "os.setxattr": ((0,), ()), "os.removexattr": ((0,), ()), "os.lchmod": ((0,), ()),
             "os.lchown": ((0,), ())}

    def hook(event, args, *, _home=home, _refused=REFUSED, _paths=PATHS, _write=WRITE, _type=type, _str=str,
             _bytes=bytes, _int=int, _len=len, _isinstance=isinstance, _getcwd=os.getcwd, _lstat=os.lstat,
             _readlink=os.readlink, _error=PermissionError, _exception=Exception, _ref_file=ref_file,
             _code=type(_hook.__code__)):
        """One function, not split: a Python helper it called could be reached and swapped (`__code__`)."""
        if event.startswith(_refused):
            raise _error(f"sandbox: {event} is refused")
        if event == "exec":
            if _ref_file and _type(args[0]) is _code and args[0].co_filename == _ref_file:
                raise _error("sandbox: running the reference's module again is refused")
            return
        if event == "open":
            checks, writes = (args[0],), False
            mode, flags = args[1], args[2]
            if _type(mode) is _str:
                writes = "w" in mode or "a" in mode or "x" in mode or "+" in mode
            writes = writes or (_type(flags) is _int and flags & _write != 0)
            if checks[0] is None:
                return
        elif event in _paths:
            where, dirs = _paths[event]
            for i in dirs:
                if i < _len(args) and args[i] != -1:
                    raise _error(f"sandbox: {event} relative to a directory descriptor is refused")
            checks, writes, mode = tuple(args[i] for i in where if i < _len(args)), True, ""
        else:
            return
        for path in checks:
            if _type(path) is _int:
                continue  # a descriptor already open (a write to one opened read-only fails)
            if _isinstance(path, _bytes):  # exact copies: a subclass's methods could answer otherwise
                path = _bytes.decode(path, "utf-8", "surrogateescape")
            elif _isinstance(path, _str):
                path = _str.__str__(path)
            else:
                raise _error(f"sandbox: {event} on a {_type(path).__name__} path is refused (pass a str)")
            if "\x00" in path:
                raise _error(f"sandbox: {event} on a path with a NUL byte is refused")
            if event == "open" and mode is None and writes and not path.startswith("/"):
                raise _error("sandbox: os.open for writing needs an absolute path (a dir_fd is not visible here)")
            if not path.startswith("/"):
                path = _getcwd() + "/" + path
            todo, done, links = path.split("/")[::-1], [], 0  # the real path, symbolic links followed
            while todo:
                part = todo.pop()
                if part == "" or part == ".":
                    continue
                if part == "..":
                    if done:
                        done.pop()
                    continue
                here = "/" + "/".join(done + [part])
                try:
                    st = _lstat(here)
                except _exception:
                    done.append(part)
                    continue
                if st.st_mode & 0o170000 == 0o120000:
                    links += 1
                    if links > 40:
                        raise _error(f"sandbox: {event}: too many symbolic links")
                    target = _readlink(here)
                    if target.startswith("/"):
                        done = []
                    todo.extend(target.split("/")[::-1])
                else:
                    done.append(part)
            real = "/" + "/".join(done)
            if writes and not (real == _home or real.startswith(_home + "/")):
                raise _error(f"sandbox: writing {real!r} outside the sandbox folder is refused")
            if real == "/proc" or real.startswith("/proc/") or real.startswith("/dev/") and real != "/dev/null":
                raise _error(f"sandbox: opening {real} is refused")

    return hook


def _expire(signum, frame):
    raise TimeoutError("over the per-call time limit")


def _probe(ref, inputs, signal, call_s):
    # the cases a reference gives: each input (a literal's text) run twice under a per-call timer,
    # each call on its own arguments; kept when both runs return the same (no raise, no address in
    # the text, at most 2000 characters) as [args, repr of the value, repr of the arguments after]
    import ast, itertools
    kept = []
    if not callable(ref):
        return kept
    for text in inputs:
        seen = []
        for _ in range(2):
            a = ast.literal_eval(text)
            signal.setitimer(signal.ITIMER_REAL, call_s)
            try:
                r = ref(*a)
                if hasattr(r, "__next__") and not isinstance(r, (str, bytes)):
                    r = list(itertools.islice(r, 1000))
                seen.append((repr(r), repr(a)))
            except TimeoutError:
                return []  # a function this slow on a small input is not one to test by calling it
            except BaseException:
                seen.append(None)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        r = seen[0]
        if r is not None and r == seen[1] and " at 0x" not in r[0] + r[1] and len(r[0]) + len(r[1]) <= 2000:
            kept.append((text, r[0], r[1]))
    return kept


def _limits(memory_bytes, file_bytes):
    import resource
    for name, value in (("RLIMIT_AS", memory_bytes), ("RLIMIT_FSIZE", file_bytes), ("RLIMIT_NOFILE", 64),
                        ("RLIMIT_CORE", 0), ("RLIMIT_NPROC", 0)):
        _set(resource, name, value)


def _limits_cpu(cpu_s):
    import resource
    _set(resource, "RLIMIT_CPU", int(cpu_s))


def _set(resource, name, value):
    limit = getattr(resource, name, None)
    if limit is None:
        return
    soft, hard = resource.getrlimit(limit)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)  # never above what this process may have: still a limit
    resource.setrlimit(limit, (value, value))


if __name__ == "__main__":
    main()
