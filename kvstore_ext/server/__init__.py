"""Runs in a server process: mxdelay's parameter server.

- :mod:`~kvstore_ext.server.controller`: :class:`DelayServer`, the controller (commands,
  hand-shake, the updater hook);
- :mod:`~kvstore_ext.server.rounds`: rounds applied in order, held rounds, pull stores and
  the pulled model of compressed pulls;
- :mod:`~kvstore_ext.server.appliers`: one applier per chunk kind, chosen once;
- :mod:`~kvstore_ext.server.registry`: the chunks a server holds (REGISTER);
- :mod:`~kvstore_ext.server.agreement`: what the workers must agree on, and their votes.

It imports the shared rooms (:mod:`kvstore_ext.protocol`, :mod:`kvstore_ext.codecs`,
:mod:`kvstore_ext.checkpoint`, :mod:`kvstore_ext.optim`), never :mod:`kvstore_ext.worker`.
"""
