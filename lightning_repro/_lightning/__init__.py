"""Every access to Lightning's private API, in one place, with the Lightning files and versions it was checked against.

No other module of lightning-repro imports a private Lightning name or reads or writes a private attribute of a
Lightning object (``tests/test_structure.py`` checks that). Each function names the Lightning file it relies on
(paths relative to ``lightning/pytorch/``); all were read in Lightning 2.5.6 and 2.6.6, where they behave alike
unless a docstring says otherwise. The modules, one concern each (among them):

* :mod:`.hooks`: the installs on a Trainer (``setup_data``, ``process_dataloader``, ``load_checkpoint``, the
  launcher) and their undo, the predict-time index recorder, the warning filter, the rest of the hook a
  checkpoint was written in;
* :mod:`.inflight`: the training batch in flight (its counters, its fetch, the hook a checkpoint is written in);
* :mod:`.guards`: what each checkpoint callback had saved (its guard against saving a step twice, its last file,
  a save it deferred to the next validation's end);
* :mod:`.loops`: loop progress (reads, writes, the checkpoint-counter corrections), the combined loader, what
  follows a training batch;
* :mod:`.cycled`: which train loaders of a ``max_size_cycle`` ``CombinedLoader`` ran out in the epoch (saved, and
  given back to the resumed epoch's iterator);
* :mod:`.lastbatch`: a resume on the last batch of an epoch whose end Lightning counts fetches no batch after it;
  whether a resume goes on in the checkpoint's epoch;
* :mod:`.results`: the epoch aggregates of ``self.log``, the trainer's metric dicts, torchmetrics' counters;
* :mod:`.signals`: SIGTERM under DDP, noted by the handler and agreed on by every rank at a training batch's end;
* :mod:`.swa`: ``StochasticWeightAveraging``'s scheduler, built again on a mid-epoch resume;
* :mod:`.strategies`: ``LauncherHooks``, the one override of ``DDPStrategy._configure_launcher`` (public hooks
  around the launcher that starts the ranks).

The folder owns these accesses and nothing else. It is the bottom of the layers: it may import no other part of
lightning-repro, only Lightning, torch and the standard library.
"""

from __future__ import annotations

from lightning_repro._lightning import guards, hooks, inflight, loops, results, signals, strategies, swa

__all__ = ["guards", "hooks", "inflight", "loops", "results", "signals", "strategies", "swa"]
