"""`python -m megatron_bapo.server --model-path DIR [--host 127.0.0.1] [--port 30000] [sglang flags]`."""

from __future__ import annotations

import asyncio
import logging
import sys

from megatron_bapo.server.config import parse_args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    config = parse_args(argv)
    logging.getLogger().setLevel(getattr(logging, config.log_level.upper(), logging.INFO))
    from megatron_bapo.server.app import serve
    from megatron_bapo.server.parent_watch import start_parent_watch

    start_parent_watch()

    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    from megatron_bapo.process_exit import exit_now

    exit_now(main())
