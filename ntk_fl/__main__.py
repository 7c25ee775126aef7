import os
import signal
import sys


def _interrupted_at_start_up(signum, frame):  # pylint: disable=unused-argument
  # Ctrl-C while the imports run: nothing was started. Leaving at once also covers a signal that lands
  # inside a native extension's import, which would otherwise surface as an ImportError traceback.
  os.write(2, b"\ninterrupted; nothing was started\n")
  os._exit(130)  # pylint: disable=protected-access


if __name__ == "__main__":  # the command, not an import of this module
  signal.signal(signal.SIGINT, _interrupted_at_start_up)

try:
  from ntk_fl import cli
  from ntk_fl.cli import __doc__  # noqa: F401  (--help prints the command's docstring)
except KeyboardInterrupt:  # Ctrl-C while the imports run: nothing was started
  sys.stderr.write("\ninterrupted; nothing was started\n")
  sys.exit(130)

if __name__ == "__main__":
  cli.main()
