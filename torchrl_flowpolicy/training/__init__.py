"""What runs and evaluates the experiments: the run lifecycle, the collectors, the logger,
the reference policy's checkpoint, the evaluation protocol and its reports.

- :mod:`~torchrl_flowpolicy.training.runs`: random generators, run checkpoints with their
  identity, resume; :mod:`~torchrl_flowpolicy.training.run_checks`: the files a run reads
  and writes, checked before any work; :mod:`~torchrl_flowpolicy.training.checkpoint`:
  atomic writes and ``weights_only`` loading.
- :mod:`~torchrl_flowpolicy.training.models`: the reference flow policy and its checkpoint
  (``load_policy``, also ``torchrl_flowpolicy.load_policy``).
- :mod:`~torchrl_flowpolicy.training.collectors`, :mod:`~torchrl_flowpolicy.training.loggers`,
  :mod:`~torchrl_flowpolicy.training.episodes`, :mod:`~torchrl_flowpolicy.training.data`,
  :mod:`~torchrl_flowpolicy.training.distributed`: rollouts, the metric log, the episodes of
  a batch, chunk datasets, data-parallel learning.
- :mod:`~torchrl_flowpolicy.training.evaluation`, :mod:`~torchrl_flowpolicy.training.protocol`,
  :mod:`~torchrl_flowpolicy.training.statistics`, :mod:`~torchrl_flowpolicy.training.reports`,
  :mod:`~torchrl_flowpolicy.training.video`, :mod:`~torchrl_flowpolicy.training.video_writing`:
  seeded evaluation, the held-out protocol, its intervals, a run's reports and videos.
- :mod:`~torchrl_flowpolicy.training.gaussian_baseline`: TorchRL's Gaussian actor, the
  baseline of ``examples/gaussian_ppo.py``.

Import each module itself (``from torchrl_flowpolicy.training import runs``): this package
imports none of them, so ``import torchrl_flowpolicy.training`` stays light.
"""
