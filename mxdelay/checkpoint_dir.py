"""The folder of periodic checkpoints: their names, the newest complete one, pruning.

The checkpoint of step S (:mod:`mxdelay.autosave`) is the trainer checkpoint
``DIR/step-<S, 8 digits or more>`` of ``DelayedTrainer.save_states``' format
(:mod:`kvstore_ext.checkpoint.files`): its index file ``step-00000400``, written last, and its parts
``step-00000400.worker<i>``, ``.kvstore`` and ``.kvstore.server<j>`` (and each part's
``.sha256``, left for worker 0 by the thread that wrote it,
:mod:`kvstore_ext.checkpoint.background`; the servers' go once the kvstore index lists
them). A checkpoint is
*complete* when its index exists: worker 0 writes it only once every part is written
(atomically, with each part's sha256), and prunes an old checkpoint index first, so a
checkpoint that lost a part never looks complete. ``load_states`` still checks every
part's sha256 and save id.

No MXNet here: ``mxdelay-launch`` reads the folder too, to say where a restarted job resumes.
"""
import logging
import os
import re

__all__ = ['path_of', 'complete', 'newest_complete', 'prune']

_LOG = logging.getLogger(__name__)

# The index (group 2 empty), a part ('.worker0', ...) or a temporary of an atomic write
# ('.step-00000400.worker0.<random>.tmp'): the step is group 1.
_NAME = re.compile(r'^\.?step-(\d{8,})(\..*)?$')


def path_of(directory, step):
    """The index of the checkpoint of `step` in `directory`."""
    return os.path.join(directory, 'step-%08d' % step)


def _names(directory):
    """``[(step, name, is_index)]`` of the checkpoint files in `directory` (none if it is
    missing or unreadable)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        match = _NAME.match(name)
        if match:
            found.append((int(match.group(1)), name,
                          match.group(2) is None and not name.startswith('.')))
    return found


def complete(directory):
    """The complete checkpoints in `directory`, newest first: ``[(step, index path)]``."""
    return [(step, os.path.join(directory, name))
            for step, name, is_index in sorted(_names(directory), reverse=True) if is_index]


def newest_complete(directory):
    """``(step, index path)`` of the newest complete checkpoint in `directory`, or None."""
    found = complete(directory)
    return found[0] if found else None


def prune(directory, keep, written):
    """Delete every checkpoint of `directory` older than the `keep` newest complete ones up
    to `written` (the step of the checkpoint just written), complete or not (each one's
    index first). Newer files stay: a save under way, or a checkpoint of an earlier run that
    the resume refused (a damaged part): counted, it would have this run's newest deleted."""
    kept = [step for step, _ in complete(directory) if step <= written][:keep]
    if not kept:
        return
    files = sorted(_names(directory), key=lambda found: not found[2])  # indexes first
    for step, name, _ in files:
        if step < kept[-1]:
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass
            except OSError as err:
                _LOG.warning('cannot delete the old checkpoint file %s: %s',
                             os.path.join(directory, name), err)
