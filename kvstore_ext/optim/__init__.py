"""Optimizers, shared by workers and servers: how both describe, compare and record an
optimizer (:mod:`~kvstore_ext.optim.optimizers`), and mxdelay's own optimizer
(:mod:`~kvstore_ext.optim.frozen_variance`), which servers apply and workers mirror.
"""
