#!/usr/bin/env python3
"""scripts/plot_metrics.py's reading of metrics.jsonl (no matplotlib needed): one point per step,
and after a resume or a rewind only the trajectory the run went on with."""

import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import plot_metrics  # noqa: E402


def write(records):
    f = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False)
    for r in records:
        f.write(json.dumps(r) + "\n")
    f.close()
    return f.name


class LoadMetrics(unittest.TestCase):
    def test_resume_from_an_earlier_checkpoint_drops_the_abandoned_steps(self):
        # Ran to step 10, then resumed from step 4's checkpoint and ended at step 6; eval_at_start
        # validated step 4 again.
        recs = [{"step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3, "grad_norm": 1.0} for s in range(1, 11)]
        recs += [{"step": s, "val_loss": 5.0 - 0.1 * s} for s in (4, 8, 10)]
        recs += [{"event": "resume", "step": 4, "checkpoint": "ck/step_00000004"}, {"step": 4, "val_loss": 4.6}]
        recs += [{"step": s, "loss": 4.7 - 0.05 * s, "lr": 1e-3, "grad_norm": 2.0} for s in (5, 6)]
        recs += [{"step": 6, "val_loss": 4.5, "val_losses": {"web": 4.4}}]
        s = plot_metrics.load_metrics(write(recs))
        self.assertEqual([p[0] for p in s["train"]], [1, 2, 3, 4, 5, 6])
        self.assertEqual(s["train"][-1], (6, 4.7 - 0.05 * 6))
        self.assertEqual(s["grad_norm"][-1], (6, 2.0))
        self.assertEqual(s["val"], [(4, 4.6), (6, 4.5)])
        self.assertEqual(s["val_sets"], {"web": [(6, 4.4)]})

    def test_rewind_keeps_the_replayed_steps_only(self):
        recs = [{"step": s, "loss": 3.0} for s in range(1, 12)]
        recs += [{"step": 12, "loss": 9.0, "skipped": True},
                 {"event": "rewind", "step": 12, "to": 10, "checkpoint": "ck/step_00000010"}]
        recs += [{"step": s, "loss": 2.5} for s in range(11, 15)]
        s = plot_metrics.load_metrics(write(recs))
        self.assertEqual(len(s["train"]), 14)
        self.assertEqual(dict(s["train"])[11], 2.5)
        self.assertEqual(dict(s["train"])[12], 2.5)

    def test_a_new_run_in_the_same_directory_drops_the_earlier_runs_records(self):
        recs = [{"step": s, "loss": 9.0} for s in range(1, 11)] + [{"step": 10, "val_loss": 9.0}]
        recs += [{"event": "start", "step": 0}] + [{"step": s, "loss": 3.0} for s in range(1, 4)]
        s = plot_metrics.load_metrics(write(recs))
        self.assertEqual(s["train"], [(1, 3.0), (2, 3.0), (3, 3.0)])
        self.assertEqual(s["val"], [])


if __name__ == "__main__":
    unittest.main()
