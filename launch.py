"""Serve the Medusa chat app: ``python launch.py`` (``--help`` lists every setting with its default).

The only module with side effects: it reads the settings, starts serving (so the page can show
the model loading), loads the model once, and serves until Ctrl+C. A model that fails to load
prints the loader's message and exits with status 1.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
import time
import webbrowser


def main(argv: list[str]) -> int:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # a local app: no phoning home

    from app.settings import AppSettings

    try:
        settings = AppSettings.from_cli(argv)
    except ValueError as e:  # one line per bad value, naming it and what is allowed
        print("\n".join(f"error: {line}" for line in str(e).splitlines()), file=sys.stderr)
        return 2
    problem = address_problem(settings.host, settings.port)
    if problem:
        print(f"error: cannot serve on {settings.host}:{settings.port}: {problem}", file=sys.stderr)
        return 1
    logging.basicConfig(
        level=logging.DEBUG if settings.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if not settings.verbose:  # its CPU fallback note ("pip install kernels") repeats at every start
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

    import torch

    torch.set_num_threads(settings.threads)  # before any model code runs

    from app.engine import SWITCH_INTERVAL_S, Engine
    from app.paths import CSS_FILE
    from app.ui import build_ui
    from medusa_core import load_medusa_model

    sys.setswitchinterval(SWITCH_INTERVAL_S)  # the serving thread gets the GIL back soon after each compiled call

    engine = Engine(f"{settings.model} ({settings.quantization} backbone, device {settings.device})", settings.kept_cache_mb,
                    served=True)  # this thread loads the model, then runs every reply's steps (engine.serve below)
    demo = build_ui(engine, settings)
    demo.queue(default_concurrency_limit=None)
    settings.exports_dir.mkdir(parents=True, exist_ok=True)
    try:
        demo.launch(
            server_name=settings.host,
            server_port=settings.port,
            share=False,
            inbrowser=False,
            prevent_thread_lock=True,
            show_error=True,
            quiet=True,
            css_paths=[CSS_FILE],
            allowed_paths=[str(settings.exports_dir)],
            # The page has no upload control, and Gradio cannot switch its upload route off: refuse every byte (HTTP 413).
            max_file_size=0,
            # Gradio's run history keeps every event's inputs (each message, the whole saved conversation) in the
            # browser's localStorage: a long message overflowed it (QuotaExceededError). The chat keeps itself.
            run_history=False,
        )
    except OSError as e:
        reason = "the port is in use: pass --port with a free one" if "empty port" in str(e) else str(e)
        print(f"error: cannot serve on {settings.host}:{settings.port}: {reason}", file=sys.stderr)
        return 1
    url = f"http://{'127.0.0.1' if settings.host in ('0.0.0.0', '::') else settings.host}:{settings.port}"
    print(f"medusa-chat: serving on {url}  (Ctrl+C stops)", flush=True)
    if settings.open:
        webbrowser.open(url)

    print(f"medusa-chat: loading {engine.description} …", flush=True)
    start = time.monotonic()
    try:
        engine.load(
            lambda: load_medusa_model(
                settings.model, base_model=settings.base_model, quantization=settings.quantization, device=settings.device,
                report=lambda line: print(f"medusa-chat: {line}", flush=True),
            )
        )
    except Exception as e:  # noqa: BLE001 - one clear line instead of a traceback wall
        if settings.verbose:
            logging.exception("loading failed")
        print(f"error: could not load {settings.model}: {e}", file=sys.stderr)
        if not settings.verbose:
            print("(run with --verbose for the traceback)", file=sys.stderr)
        demo.close()
        return 1
    model = engine.model
    print(
        f"medusa-chat: ready in {time.monotonic() - start:.1f} s: {model.name} on {model.device}, "
        f"{model.num_heads} heads, default tree {model.default_tree}; open {url}",
        flush=True,
    )
    model.index_corpus_in_background()  # the model's own replies for "heads + corpus" drafts, now, not at a first reply
    try:
        engine.serve()  # every reply's steps on this thread, which loaded the model, until Ctrl+C
    except KeyboardInterrupt:
        pass
    finally:
        demo.close()
    return 0


def address_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be served (by binding it once), or None.

    Gradio reports every bind failure as a port in use; this tells a busy port from an address the
    machine does not have, a host name that does not resolve and a port that needs privileges.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        return f"the host name {host} does not resolve ({e.strerror})"
    with socket.socket(family, kind, proto) as s:
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return "the port is in use: pass --port with a free one"
            if e.errno == errno.EADDRNOTAVAIL:
                return f"{host} is not an address of this machine: use 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"
            if e.errno == errno.EACCES:
                return f"no permission to use port {port} (ports below 1024 need administrator rights)"
            return e.strerror or str(e)
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
