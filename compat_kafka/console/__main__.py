"""``python -m compat_kafka.console ARGS``: ``scroll console ARGS`` as ``scroll standalone`` starts it (a
child process, by module name): the ``scroll`` group around it reads the bookie credentials of
its environment (``SCROLL_TLS_CA``, ``SCROLL_TOKEN_FILE``) and stops it with its parent."""

import sys

from streams.tools.cli import main

from .cli import console_command

if __name__ == "__main__":
    main.add_command(console_command, "console")
    main(args=["console", *sys.argv[1:]], prog_name="scroll")
