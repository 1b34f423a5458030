"""An offline lm_eval task for the CPU lane (no hub): generated arithmetic word problems in
gsm8k's answer format (``#### N``), scored with gsm8k's strict-match regex filter.

Written at run time into a folder of the run (the task YAML names its JSONL by absolute path).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

TASK = "pd_arith"
NAMES = ("Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun")
ITEMS = ("apples", "books", "coins", "marbles", "pencils", "shells", "stamps", "tickets")


def task_doc(data: Path) -> dict[str, Any]:
    """The lm_eval task definition (written with yaml.safe_dump: no hand-escaped templates)."""
    return {
        "task": TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {
            "until": ["Question:", "\n\n"],
            "do_sample": False,
            "temperature": 0.0,
            "max_gen_toks": 24,
        },
        "filter_list": [
            {
                "name": "strict-match",
                "filter": [
                    {"function": "regex", "regex_pattern": r"#### (\-?[0-9\.\,]+)"},
                    {"function": "take_first"},
                ],
            }
        ],
        "metric_list": [
            {
                "metric": "exact_match",
                "aggregation": "mean",
                "higher_is_better": True,
                "ignore_case": True,
                "ignore_punctuation": False,
            }
        ],
        "num_fewshot": 0,
        "metadata": {"version": 1.0},
    }


def problems(n: int = 24, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        who, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(1, 9)
        total = a + b - c
        q = (
            f"{who} has {a} {item} and finds {b} more, then gives {c} away. "
            f"How many {item} does {who} have now?"
        )
        ans = f"{who} has {a} + {b} = {a + b} {item}, then {a + b} - {c} = {total}.\n#### {total}"
        out.append({"question": q, "answer": ans})
    return out


def write_task(folder: Path, n: int = 24) -> Path:
    """Write the JSONL and the task YAML into ``folder``; return the folder (an include_path)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{TASK}.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in problems(n)))
    import yaml  # lm_eval's own dependency: present wherever the accuracy check runs

    (folder / f"{TASK}.yaml").write_text(yaml.safe_dump(task_doc(data), sort_keys=False))
    return folder
