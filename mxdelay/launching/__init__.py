"""The parts of ``mxdelay-launch`` (:mod:`mxdelay.launcher`), one concern each.

- :mod:`.options`: the options, checked once (:class:`~.options.Config`);
- :mod:`.hostfiles`: ssh and netns hostfiles, read and checked;
- :mod:`.role`: one role's process: its command line (local, netns, ssh), start and exit;
- :mod:`.output`: the roles' output, prefixed line by line;
- :mod:`.job`: one job: placement, each role's variables, fail-fast supervision, stopping;
- :mod:`.restarts`: ``--max-restarts``: the job again after a failure, with a back-off.

None of them loads MXNet.
"""
__all__ = []
