"""What workers and servers both say: shared by both processes.

- :mod:`~kvstore_ext.protocol.commands`: commands and replies on MXNet's command channel,
  the optimizer on the wire, field checks;
- :mod:`~kvstore_ext.protocol.keys`: the integer keys of a job and the server of each;
- :mod:`~kvstore_ext.protocol.counter`: the finish counter's layout;
- :mod:`~kvstore_ext.protocol.schedule`: which rounds every worker pulls.
"""
