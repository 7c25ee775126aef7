"""Runs one experiment from a config: the ``ntk-fl`` command, from a checkout.

  python experiments/main.py --config=configs/ntk_dfl.py[:variant] --workdir=DIR
      [--config.rounds=50 --config.data.alpha=0.5 ...] [--resume]
      [--branch_from=OTHER_WORKDIR [--branch_round=K]]
      [--num_processes=P | --distributed | --num_processes=P --process_id=I --coordinator_address=HOST:PORT]

Same flags and behaviour as the installed ``ntk-fl`` console script (see
:mod:`ntk_fl.cli`); ``--config`` also takes a packaged config's name
(``--config=ntk_dfl:smoke``).
"""

from ntk_fl import cli

if __name__ == "__main__":
  cli.main()
