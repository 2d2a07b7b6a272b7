"""Runs in a server process: mxdelay's parameter server.

- :mod:`~kvstore_ext.server.controller`: :class:`DelayServer`, the controller (the command
  table, the updater hook) and its parts, one concern each: the job and its status key
  (:mod:`~kvstore_ext.server.job`), the hand-shake (:mod:`~kvstore_ext.server.handshake`),
  the chunks and the optimizer (:mod:`~kvstore_ext.server.optimizer`), checkpoints
  (:mod:`~kvstore_ext.server.checkpoint`), stock MXNet workers
  (:mod:`~kvstore_ext.server.stock`), a round by its key's kind
  (:mod:`~kvstore_ext.server.key_rounds`);
- :mod:`~kvstore_ext.server.rounds`: rounds applied in order and held rounds, with their
  parts: the optimizer and each chunk's applier (:mod:`~kvstore_ext.server.updates`,
  :mod:`~kvstore_ext.server.appliers`), pull and model keys
  (:mod:`~kvstore_ext.server.pulled`), aux values (:mod:`~kvstore_ext.server.aux`);
- :mod:`~kvstore_ext.server.registry`: the chunks a server holds (REGISTER);
- :mod:`~kvstore_ext.server.agreement`: what the workers must agree on, and their votes.

It imports the shared rooms (:mod:`kvstore_ext.protocol`, :mod:`kvstore_ext.codecs`,
:mod:`kvstore_ext.checkpoint`, :mod:`kvstore_ext.optim`), never :mod:`kvstore_ext.worker`.
"""
