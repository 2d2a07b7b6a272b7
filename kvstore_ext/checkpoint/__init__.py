"""Checkpoint files, written and read by workers and servers alike: names, versions,
formats and atomic writes (:mod:`~kvstore_ext.checkpoint.files`). What a worker saves is
:mod:`kvstore_ext.worker.store_checkpoint`'s; what a server saves, its controller's.
"""
