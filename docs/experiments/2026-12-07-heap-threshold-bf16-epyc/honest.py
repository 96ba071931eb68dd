"""The split-half honest estimate of one run, from its epochs' dev dumps, as `stages.stats` computes it.

python honest.py <params.yaml> <tokenized dir> <folder holding the run's snapshots as <name>/epoch-<E>> <name>
"""
import json
import sys
from pathlib import Path

from mtbert.data.batches import load_split
from mtbert.data.tasks import tasks_from_params
from mtbert.evaluation.seeds import honest_group
from mtbert.params_file import load_params

params_file, tokenized, snapshots, name = sys.argv[1:5]
tasks = tasks_from_params(load_params(Path(params_file)).tasks)
dev_splits = {task_name: load_split(Path(tokenized), task, "dev") for task_name, task in tasks.items()}
print(json.dumps({name: honest_group([name], Path(snapshots), dev_splits, tasks)}))
