"""``fullband experiment``: the paper's questions, asked at a size a CPU can answer. This module registers them:

* ``data-efficiency`` (:mod:`.data_efficiency`): baselines at several token budgets vs FBT at 1x -- the effective
  token multiplier and the matched-compute comparison;
* ``reasoning`` (:mod:`.reasoning_experiment`): baseline, FBT and an equal-FLOPs baseline on synthetic problems
  written with traces of mixed verbosity -- accuracy and trace length per decode mode and verbosity, >= 2 seeds,
  paired statistics;
* ``recipe`` (:mod:`.recipe`): the feedback recipe grid -- every mode, equal tokens and equal FLOPs, >= 2 seeds;
* ``depth`` (:mod:`.depth`): k-hop pointer chasing and iterated composition -- does FBT(L) reach baseline(2L)?
* ``state`` (:mod:`.state_experiment`): running-state tasks with a label at every position (S3 / S5 word problem,
  parity, variable tracking) -- FBT trained with long recurrences vs baselines of 1, 2 and 4x depth, at T, 2T, 4T;

Each writes ``results.json`` and ``report.md`` into ``--out`` and prints its tables; trained models stay in
``OUT/runs/`` (``OUT/seed*/`` for the recipe grid).
"""


from __future__ import annotations

import argparse

from .data_efficiency import DE_DEFAULTS, run_data_efficiency
from .data_efficiency import __doc__ as data_efficiency_doc
from .depth import add_parser as add_depth_parser
from .experiment_common import add_common_arguments, add_recipe_arguments
from .reasoning_experiment import add_parser as add_reasoning_parser
from .state_experiment import add_parser as add_state_parser
from .recipe import add_parser as add_recipe_parser

# ============================================================================================== CLI


def add_parser(sub) -> None:
    p = sub.add_parser("experiment", help="experiments: recipe (the feedback recipe grid), data-efficiency, reasoning, depth, state",
                       description=__doc__.split("\n\n")[0])
    ex = p.add_subparsers(dest="experiment", metavar="EXPERIMENT")
    p.set_defaults(func=lambda args: (p.print_help(), 0)[1])

    d = ex.add_parser("data-efficiency", help="baselines at several token budgets vs FBT at 1x: effective token "
                                              "multiplier and matched-compute comparison",
                      description=data_efficiency_doc.split("\n", 1)[1],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(d, DE_DEFAULTS)
    d.add_argument("--data", default=DE_DEFAULTS["data"],
                   help="training text, as `fullband train --data` (default: the embedded corpus)")
    d.add_argument("--multipliers", default=DE_DEFAULTS["multipliers"],
                   help="baseline token budgets as multiples of the FBT run's (must include 1) (default: "
                        f"{DE_DEFAULTS['multipliers']})")
    d.add_argument("--eval-rows", type=int, default=DE_DEFAULTS["eval_rows"],
                   help=f"held-out rows evaluated, the same for every run (default: {DE_DEFAULTS['eval_rows']})")
    add_recipe_arguments(d)
    d.set_defaults(func=lambda args: (run_data_efficiency(args), 0)[1])

    add_reasoning_parser(ex)
    add_recipe_parser(ex)
    add_depth_parser(ex)
    add_state_parser(ex)
