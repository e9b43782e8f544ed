"""The default task, gymnasium's ``Pusher-v5``: :mod:`~torchrl_flowpolicy.tasks.pusher.env`
(task facts, the success test, the TorchRL environment),
:mod:`~torchrl_flowpolicy.tasks.pusher.expert` (the scripted expert) and
:mod:`~torchrl_flowpolicy.tasks.pusher.demos` (its demonstrations). Import the names from
those modules or from :mod:`torchrl_flowpolicy.tasks`."""
