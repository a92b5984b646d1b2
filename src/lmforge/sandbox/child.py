"""The program a sandboxed interpreter runs (`python -I -c` this file's text; lmforge.sandbox
starts it). It is not imported by lmforge: it runs in the child, where the candidate lives.

argv: the verdict pipe's fd, the timeout (s), the address-space and file-size limits (bytes).
The job (JSON, with the parent's nonce) arrives on stdin. Everything lives inside main(): no
module global holds the nonce, and the audit hook's state is a closure the candidate cannot
reach once frames and the collector are refused. See lmforge.sandbox for what is refused and why.
"""

def main():
    import builtins, contextlib, doctest, importlib, io, json, os, signal, sys
    fd = int(sys.argv[1])
    _limits(float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    job = json.loads(sys.stdin.buffer.read())
    nonce = job.pop("nonce")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    home = os.path.realpath(os.getcwd())

    def say(**msg):
        os.write(fd, (json.dumps(dict(msg, nonce=nonce)) + "\n").encode())

    guard = [False]
    WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    REFUSED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
               "os.forkpty", "os.kill", "os.killpg", "os.setsid", "ctypes.", "sys._getframe",
               "sys._current_frames", "sys.settrace", "sys.setprofile", "gc.get_", "object.__getattr__",
               "pty.", "resource.setrlimit", "os.chroot", "shutil.", "os.startfile", "webbrowser.")
    PATHS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
             "os.truncate", "os.utime", "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr")

    def inside(path):
        try:
            p = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else f"/proc/self/fd/{path}")
        except Exception:
            return False
        return p == home or p.startswith(home + os.sep)

    def hook(event, args):
        if not guard[0]:
            return
        if event.startswith(REFUSED):
            raise PermissionError(f"sandbox: {event} is refused")
        if event == "open":
            path, mode, flags = args
            if path is None:
                return
            text = os.fsdecode(path) if not isinstance(path, int) else ""
            if text.startswith("/proc") or text.startswith("/dev/") and text != os.devnull:
                raise PermissionError(f"sandbox: opening {text} is refused")
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & WRITE
            if writes and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the sandbox folder is refused")
        elif event in PATHS or event.startswith(PATHS):
            for a in args[:2]:
                if isinstance(a, (str, bytes, os.PathLike)) and not inside(a):
                    raise PermissionError(f"sandbox: {event} outside the sandbox folder is refused")

    def expire(signum, frame):
        raise TimeoutError("over the per-call time limit")

    signal.signal(signal.SIGALRM, expire)
    sys.addaudithook(hook)
    try:
        mod = importlib.import_module(job["module"]) if job.get("module") else None
        ref = getattr(mod, job.get("function", ""), None) if mod is not None else None
        doc = job.get("doc") if job.get("doc") is not None else (getattr(ref, "__doc__", None) or "")
        ns = dict(vars(mod)) if mod is not None else {"__name__": "__sandbox__", "__builtins__": builtins}
    except BaseException as exc:
        say(verdict="ERROR", detail=f"the harness could not import {job.get('module')!r}: {type(exc).__name__}")
        return
    say(ready=True)
    out = io.StringIO()
    verdict, detail, data = "FAIL", "", None
    guard[0] = True
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if job["kind"] == "probe":  # the references themselves, on inputs: no candidate
                data = {name: _probe(getattr(mod, name, None), inputs, signal, job.get("call_s", 0.25))
                        for name, inputs in job["probes"].items()}
                verdict, detail = "PASS", f"{sum(map(len, data.values()))} cases kept"
                raise StopIteration
            exec(compile(job["source"], "<candidate>", "exec"), ns)
            cand = ns.get(job["function"])
            if not callable(cand):
                raise NameError(f"the candidate defines no function {job['function']!r}")
            if mod is not None:
                setattr(mod, job["function"], cand)
            if job["kind"] == "doctest":
                verdict, detail = _doctests(doctest, out, doc, ns, job["function"])
            elif job["kind"] == "cases":
                verdict, detail = _cases(cand, job["cases"])
            else:
                verdict, detail = "ERROR", f"unknown job kind {job['kind']!r}"
    except StopIteration:
        pass
    except MemoryError:
        verdict, detail = "OOM", "MemoryError"
    except RecursionError:
        verdict, detail = "FAIL", "RecursionError"
    except BaseException as exc:
        verdict, detail = "FAIL", f"{type(exc).__name__}: {str(exc)[:160]}"
    guard[0] = False
    say(verdict=verdict, detail=detail, data=data)


def _doctests(doctest, out, doc, ns, name):
    examples = doctest.DocTestParser().get_examples(doc)
    if not examples:
        return "NODOC", f"{name} has no >>> examples"
    check = doctest.OutputChecker()
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    for i, ex in enumerate(examples):
        out.seek(0)
        out.truncate()
        try:
            exec(compile(ex.source, f"<example {i + 1}>", "single"), ns)
            got = out.getvalue()
            if ex.exc_msg is not None or not check.check_output(ex.want, got, flags):
                return "FAIL", f"example {i + 1}: wrong output"
        except MemoryError:
            return "OOM", f"example {i + 1}: MemoryError"
        except Exception as exc:  # the line doctest compares, built without touching the traceback (refused)
            kind = type(exc).__qualname__
            if type(exc).__module__ not in ("builtins", "__main__"):
                kind = f"{type(exc).__module__}.{kind}"
            got = f"{kind}: {exc}\n" if str(exc) else f"{kind}\n"
            if ex.exc_msg is None or not check.check_output(ex.exc_msg, got, flags):
                return "FAIL", f"example {i + 1}: raised {type(exc).__name__}"
    return "PASS", f"{len(examples)} examples"


def _outcome(fn, args):
    # (repr of the value returned, repr of the arguments after the call): an iterator is read
    # (at most 1000 items), so a generator compares by what it yields
    a = eval(args, {"__builtins__": {}})
    r = fn(*a)
    if hasattr(r, "__next__") and not isinstance(r, (str, bytes)):
        import itertools
        r = list(itertools.islice(r, 1000))
    return repr(r), repr(a)


def _cases(cand, cases):
    for i, case in enumerate(cases):
        args, want = case[0], case[1]
        try:
            got, after = _outcome(cand, args)
            if len(case) > 2 and after != case[2]:
                got = f"{got} (arguments left as {after})"
        except MemoryError:
            return "OOM", f"case {i + 1}: MemoryError"
        except Exception as exc:
            got = "raise " + type(exc).__name__
        if got != want:
            return "FAIL", f"case {i + 1}: got {got[:80]}, expected {want[:80]}"
    return "PASS", f"{len(cases)} cases"


def _probe(ref, inputs, signal, call_s):
    # the cases a reference gives: each input run twice under a per-call timer; kept when both
    # runs return the same (no raise, no address in the text, at most 2000 characters)
    kept = []
    if not callable(ref):
        return kept
    for args in inputs:
        seen = []
        for _ in range(2):
            signal.setitimer(signal.ITIMER_REAL, call_s)
            try:
                seen.append(_outcome(ref, args))
            except TimeoutError:
                return []  # a function this slow on a small input is not one to test by calling it
            except BaseException:
                seen.append(None)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        r = seen[0]
        if r is not None and r == seen[1] and " at 0x" not in r[0] + r[1] and len(r[0]) + len(r[1]) <= 2000:
            kept.append([args, r[0], r[1]])
    return kept


def _limits(timeout, memory_bytes, file_bytes):
    import resource
    cpu = int(timeout) + 1
    for name, value in (("RLIMIT_AS", memory_bytes), ("RLIMIT_CPU", cpu), ("RLIMIT_FSIZE", file_bytes),
                        ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0), ("RLIMIT_NPROC", 64)):
        limit = getattr(resource, name, None)
        if limit is not None:
            try:
                resource.setrlimit(limit, (value, value))
            except (ValueError, OSError):
                pass


if __name__ == "__main__":
    main()
