"""Runs in a worker process: the ``'dist_delay'`` store and its data paths.

- :mod:`~kvstore_ext.worker.dist_delay`: :class:`DistDelay`, the ``KVStoreBase`` face;
- the data paths of keys, one per kind, chosen at ``init``: :mod:`~kvstore_ext.worker.dense`
  (slot keys), :mod:`~kvstore_ext.worker.float16_keys` (float16 pushes, float32 pull keys),
  :mod:`~kvstore_ext.worker.row_keys` (one row per worker), :mod:`~kvstore_ext.worker.sparse`
  (row_sparse keys), :mod:`~kvstore_ext.worker.aux_states` (averaged aux states); which
  dense path a codec travels by, :mod:`~kvstore_ext.worker.wires`; compressed pulls mixed
  in, :mod:`~kvstore_ext.worker.pulled_model`;
- where tensors live: :mod:`~kvstore_ext.worker.layout` (chunks, placement, slot buffers);
- talking to the servers: :mod:`~kvstore_ext.worker.channel` (hand-shake, commands, votes),
  :mod:`~kvstore_ext.worker.statefetch` (the servers' optimizer state),
  :mod:`~kvstore_ext.worker.finish` (the finish counter),
  :mod:`~kvstore_ext.worker.store_checkpoint` (save and load in agreement);
- what MXNet and Gluon need of the store: :mod:`~kvstore_ext.worker.arguments`,
  :mod:`~kvstore_ext.worker.store_errors`, :mod:`~kvstore_ext.worker.hooks`,
  :mod:`~kvstore_ext.worker.gluon_sparse`, :mod:`~kvstore_ext.worker.module_path`.

Nothing here runs in a server; the server imports nothing from here (``tests/test_layers.py``).
"""
