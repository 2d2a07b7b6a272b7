"""Runs in a worker process: the ``'dist_delay'`` store and its data paths.

- :mod:`~kvstore_ext.worker.dist_delay`: :class:`DistDelay`, the ``KVStoreBase`` face, and
  ``DistDelay.delayed``, the parts that only the delayed update uses:
  :mod:`~kvstore_ext.worker.settings` (slack, chunk size, shared settings, pull codec),
  :mod:`~kvstore_ext.worker.rounds` (rounds, compressed pulls, gradient scaling, AMP's flags),
  :mod:`~kvstore_ext.worker.uneven` (the finish vote, the rounds a leaving worker fills),
  :mod:`~kvstore_ext.worker.statefetch` (the servers' optimizer state),
  :mod:`~kvstore_ext.worker.store_checkpoint` (save and load in agreement, residuals, pulled
  models), :mod:`~kvstore_ext.worker.job` (barrier, vote, server statistics),
  :mod:`~kvstore_ext.worker.bytecount` (bytes per push and pull) and
  :mod:`~kvstore_ext.worker.aux_states` (averaged aux states);
- what the face and the parts share: :mod:`~kvstore_ext.worker.session` (the native store,
  the hand-shake, the placed tensors); :mod:`~kvstore_ext.worker.placing` places keys at
  ``init``;
- the data paths of keys, one per kind, chosen at ``init``: the wires of dense keys,
  :mod:`~kvstore_ext.worker.wires` (slot keys, float32 pull keys, one row per worker: one
  module each, chosen by the codec), each with its pull strategy (exact or compressed
  pulls, :mod:`~kvstore_ext.worker.wires.pulls`);
  :mod:`~kvstore_ext.worker.sparse` (row_sparse keys), :mod:`~kvstore_ext.worker.aux_states`
  (aux states); their ordering in MXNet's engine, :mod:`~kvstore_ext.worker.ordering`;
  AMP's flag of a round, :mod:`~kvstore_ext.worker.finite`;
- where tensors live: :mod:`~kvstore_ext.worker.layout` (chunks, placement, slot buffers);
- talking to the servers: :mod:`~kvstore_ext.worker.channel` (hand-shake, commands, votes),
  :mod:`~kvstore_ext.worker.finish` (the finish counter);
- what MXNet and Gluon need of the store: :mod:`~kvstore_ext.worker.arguments`,
  :mod:`~kvstore_ext.worker.store_errors`, :mod:`~kvstore_ext.worker.hooks`,
  :mod:`~kvstore_ext.worker.gluon_sparse`, :mod:`~kvstore_ext.worker.module_path`.

Nothing here runs in a server; the server imports nothing from here (``tests/test_layers.py``).
"""
