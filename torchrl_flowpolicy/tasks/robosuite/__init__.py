"""robosuite's manipulation tasks (Lift, PickPlaceCan, NutAssemblySquare) with their scripted
experts, needing the ``[robosuite]`` extra only when an environment or an expert is built.

:mod:`~torchrl_flowpolicy.tasks.robosuite.layout` and
:mod:`~torchrl_flowpolicy.tasks.robosuite.registry` import no simulator (the task registry
reads them); :mod:`~torchrl_flowpolicy.tasks.robosuite.env` and the expert modules import
robosuite's own modules when they run.
"""
