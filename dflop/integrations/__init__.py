"""dflop's bins inside trainers people already run, without leaving them.

Each module here adapts dflop's per-rank sampler (:mod:`dflop.schedule.sampler`) to one trainer's
extension points and imports that trainer's package; nothing in dflop's planning layers imports
these modules, so the trainers stay optional. :mod:`dflop.integrations.transformers`: the Hugging
Face Trainer; :mod:`dflop.integrations.collate`: packed and padded collators for microbatches of a
variable number of samples.
"""
