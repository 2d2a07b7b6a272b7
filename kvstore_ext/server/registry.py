"""The chunks the workers register with a server: ``REGISTER``'s entries, checked and kept.

Every server hears every chunk, so each knows whole tensors (docs/design.md §3.4), and keeps
its own chunks by id and by local index: a chunk's local index counts its server's chunks in
chunk id order, as the workers' ``Placement`` does (docs/design.md §2.6). A chunk's
registration (:data:`INFO_FIELDS`) must be the same from every worker and in a checkpoint.
An aux chunk (codec :data:`kvstore_ext.protocol.commands.AUX_SETTINGS`, docs/design.md §2.13) holds aux states:
it is no tensor the optimizer sees.
"""
from kvstore_ext.protocol import commands
from kvstore_ext.protocol.commands import field
from kvstore_ext.server import appliers

__all__ = ['INFO_FIELDS', 'parse_entries', 'ChunkRegistry']

#: What a chunk's registration says, compared between workers and with a checkpoint.
INFO_FIELDS = ('param_index', 'name', 'lr_mult', 'wd_mult', 'size', 'codec')


def parse_entries(chunks):
    """``REGISTER``'s ``chunks`` as info dicts with ``'chunk'`` and ``'server'``, every
    field's type and range and their codec settings checked; an entry of 7 (``[chunk_id,
    server, param_index, name, lr_mult, wd_mult, size]``) has none (``{}``).

    Raises
    ------
    ValueError
        For an entry of another form, a field of another type or out of range (naming it
        and its value), bad codec settings (naming the chunk, the setting and its value),
        or codec settings on the finish counter.
    """
    _check_fields(chunks)
    entries = []
    for entry in chunks:
        if not isinstance(entry, list) or len(entry) not in (7, 8):
            raise ValueError('a registered chunk is [chunk_id, server, param_index, name, '
                             'lr_mult, wd_mult, size, codec], got %.200r' % (entry,))
        codec = appliers.check_codec(entry[0], entry[7] if len(entry) == 8 else {})
        if codec and entry[2] == commands.FINISH_KEY:
            raise ValueError('chunk %s is the finish counter, which takes no codec settings, '
                             'got %r' % (entry[0], codec))
        entries.append(dict(zip(('chunk', 'server') + INFO_FIELDS, entry[:7] + [codec])))
    return entries


def _check_fields(chunks):
    """Each field's type and range in every entry of `chunks`, before any is parsed."""
    for entry in chunks:
        if not isinstance(entry, list) or len(entry) not in (7, 8):
            continue   # parse_entries refuses it, with the form expected
        body = dict(zip(('chunk_id', 'server', 'param_index', 'name', 'lr_mult', 'wd_mult',
                         'size'), entry))
        field(body, 'chunk_id', int, minimum=0)
        field(body, 'server', int, minimum=0)
        # The store's key: an int, or a str as MXNet allows (Module's parameter names, the
        # finish counter's commands.FINISH_KEY).
        if not isinstance(body['param_index'], str):
            field(body, 'param_index', int, minimum=0)
        field(body, 'name', str)
        for name in ('lr_mult', 'wd_mult'):
            field(body, name, float, finite=True)
        field(body, 'size', int, minimum=1)   # the codec: parse_entries checks it


class ChunkRegistry(object):
    """One server's view of the registered chunks."""

    def __init__(self):
        self._chunks = {}              # chunk id -> its info (INFO_FIELDS)
        self._local_chunks = []        # local index -> chunk id: keys are numbered by it
        self._tensors = {}             # param index -> {'name', 'size', 'chunks'}, every server's

    def add(self, entries, server_rank, worker, check_tensors, on_chunk):
        """Register worker `worker`'s `entries` (:func:`parse_entries`) on server
        `server_rank`.

        ``check_tensors(tensors)`` may refuse the tensors known with them before anything is
        kept; then ``on_chunk(chunk, info)`` is called for each of this server's chunks.

        Raises
        ------
        ValueError
            For a chunk registered after one of a higher id, or otherwise than before.
        """
        tensors = {}
        for entry in entries:
            # The tensors the optimizer updates (whole-tensor optimizers check them).
            if entry['param_index'] != commands.FINISH_KEY and entry['codec'] != appliers.AUX:
                tensor = tensors.setdefault(entry['param_index'],
                                            {'name': entry['name'], 'size': 0, 'chunks': 0})
                tensor['size'] += entry['size']
                tensor['chunks'] += 1
        check_tensors({**self._tensors, **tensors})
        self._tensors.update(tensors)
        for entry in entries:
            if entry['server'] != server_rank:
                continue
            chunk, info = entry['chunk'], {name: entry[name] for name in INFO_FIELDS}
            if chunk not in self._chunks:
                if self._local_chunks and chunk < self._local_chunks[-1]:
                    raise ValueError('worker %s registers chunk %d after chunk %d: every worker '
                                     'must initialise the same keys in the same order'
                                     % (worker, chunk, self._local_chunks[-1]))
                self._local_chunks.append(chunk)
            known = self._chunks.setdefault(chunk, info)
            if known != info:
                raise ValueError('worker %s registers chunk %d as %r but another worker as %r: '
                                 'every worker must build the same model'
                                 % (worker, chunk, info, known))
            on_chunk(chunk, info)

    def tensors(self):
        """Param index -> ``{'name', 'size', 'chunks'}`` of every server's registered tensors."""
        return dict(self._tensors)

    def __len__(self):
        return len(self._chunks)

    def __contains__(self, chunk):
        """Whether `chunk` is one of this server's."""
        return chunk in self._chunks

    def local_count(self):
        """How many local indexes this server has numbered."""
        return len(self._local_chunks)

    def chunk_at(self, local):
        """The chunk id of local index `local`."""
        return self._local_chunks[local]

    def ids(self):
        """This server's chunk ids, sorted."""
        return sorted(self._chunks)

    def is_counter(self, chunk):
        """Whether `chunk` is the finish counter's."""
        return self.key(chunk) == commands.FINISH_KEY

    def is_aux(self, chunk):
        """Whether `chunk` is one of this server's aux chunks (docs/design.md §2.13)."""
        return chunk in self and self._chunks[chunk]['codec'] == appliers.AUX

    def size(self, chunk):
        """The registered number of elements of this server's `chunk`."""
        return self._chunks[chunk]['size']

    def reads_slot_keys(self, chunk):
        """Whether the pulls of `chunk` read its slot keys even with float16 pushes (no pull
        keys, docs/design.md §2.11): the finish counter's and aux chunks (§2.13)."""
        return self.is_counter(chunk) or self.is_aux(chunk)

    def key(self, chunk):
        """The kvstore key (the worker's parameter index) that `chunk` is part of."""
        return self._chunks[chunk]['param_index']

    def saved(self, chunk, state):
        """What a checkpoint keeps of `chunk`: its info and its `state` (the round keeper's
        ``chunk_state``)."""
        return dict(self._chunks[chunk], **state)

    def check_saved(self, path, saved_chunks):
        """Refuse a checkpoint `path` whose chunks (``saved``'s dict) differ from these."""
        if set(saved_chunks) != set(self._chunks):
            raise ValueError('%s holds chunks %s, this server has %s: the model differs from '
                             'the one that was saved' % (path, sorted(saved_chunks),
                                                         sorted(self._chunks)))
        for chunk, saved in saved_chunks.items():
            # A checkpoint of before codec settings has none: it was saved without any.
            info = {name: saved.get(name, {}) if name == 'codec' else saved[name]
                    for name in INFO_FIELDS}
            if info['codec'] == {} and self._chunks[chunk]['codec'] == appliers.AUX:
                # Saved before aux chunks had a kind of their own (docs/design.md §2.13):
                # the same aux states, registered with no settings then.
                info['codec'] = appliers.AUX
            if info != self._chunks[chunk]:
                raise ValueError('%s: chunk %d was %r when saved, is %r now'
                                 % (path, chunk, info, self._chunks[chunk]))
