"""``python -m eagledata.standin --tokenizer DIR --family NAME [...]``: run the stand-in server in the
foreground until SIGTERM or Ctrl-C (prints its base URL; ``--port-file`` gets the port)."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path
from typing import Sequence

from eagledata.standin.faults import Fault
from eagledata.standin.profiles import PROFILES
from eagledata.standin.server import SimulatorServer


def parser() -> argparse.ArgumentParser:
    """The command line's arguments."""
    ap = argparse.ArgumentParser(prog="python -m eagledata.standin",
                                 description="A local stand-in for OpenRouter's chat-completions API (or SGLang's), with ground truth.")
    ap.add_argument("--tokenizer", required=True, help="tokenizer directory (tiktoken or HF)")
    ap.add_argument("--family", required=True, help="model family, e.g. kimi-k2.5")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: an ephemeral port")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="exact", choices=sorted(PROFILES))
    ap.add_argument("--api", default="openrouter", choices=("openrouter", "sglang"))
    ap.add_argument("--sglang-trim-stop", action="store_true", help="--api sglang: leave the matched stop id out of the ids")
    ap.add_argument("--sglang-prompt-echo", type=int, default=0, metavar="N",
                    help="--api sglang: put the prompt's last N ids before the output ids (5: SGLang releases whose "
                         "detokenizer returned its decode window)")
    ap.add_argument("--sglang-no-chat-token-ids", action="store_true",
                    help="--api sglang: the chat endpoint ignores return_token_ids (SGLang before #30917)")
    ap.add_argument("--latency-ms", type=float, default=0, help="each answer's latency (its body, or its whole paced stream)")
    ap.add_argument("--latency-jitter-ms", type=float, default=0, help="adds uniform(0, this) to each latency")
    ap.add_argument("--paced-streams", action="store_true",
                    help="spread each SSE stream over its latency (first chunk, then chunks of a few tokens at a "
                         "constant rate) instead of sending it whole after the latency")
    ap.add_argument("--first-token-ms", type=float, default=None,
                    help="paced streams: time to the first chunk (default: a tenth of the latency)")
    ap.add_argument("--stream-write-ms", type=float, default=20,
                    help="paced streams: the chunks due within this interval leave in one write (0: one write per chunk)")
    ap.add_argument("--price", type=float, nargs=2, metavar=("PROMPT", "COMPLETION"), default=(0.6, 2.5),
                    help="USD per million tokens")
    ap.add_argument("--content-tokens", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    ap.add_argument("--reasoning-tokens", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    ap.add_argument("--fault", action="append", default=[], metavar="N=KIND",
                    help="inject a fault into request N, e.g. 3=429, 4=502, 5=error-in-200, 6=mid-stream, 7=reset")
    ap.add_argument("--port-file", help="write the port here once listening")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Start the server from the command line and serve until stopped."""
    from eagledata.text.families import get_family
    from eagledata.text.tokenizer import load_tokenizer

    args = parser().parse_args(argv)
    faults = {}
    for spec in args.fault:
        n, _, kind = spec.partition("=")
        faults[int(n)] = Fault.parse(kind)
    options = {k: tuple(v) for k, v in (("content_tokens", args.content_tokens), ("reasoning_tokens", args.reasoning_tokens)) if v}
    family = get_family(args.family)
    tok = load_tokenizer(args.tokenizer, family)
    server = SimulatorServer(tok, family, seed=args.seed, profile=args.profile, latency_ms=args.latency_ms,
                             latency_jitter_ms=args.latency_jitter_ms, paced_streams=args.paced_streams,
                             first_token_ms=args.first_token_ms, stream_write_ms=args.stream_write_ms, price_per_mtok=tuple(args.price), faults=faults,
                             host=args.host, port=args.port, api=args.api, sglang_trim_stop=args.sglang_trim_stop,
                             sglang_prompt_echo=args.sglang_prompt_echo,
                             sglang_chat_token_ids=not args.sglang_no_chat_token_ids, **options).start()
    if args.port_file:
        Path(args.port_file).write_text(str(server.port))
    print(f"simulator ({args.api}, {args.profile}, {family.name}) listening: {server.base_url} "
          f"(counters: {server.root_url}/_sim/counters)", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(3600):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
