"""The portable backend (``backend.PortableBackend``): the call agreement and its handshake, the
normal and low-latency modes, and the wire helpers they use (routing digests, the low-latency send
order and receive layout), over any ``moe_comm.transport``.

Nothing is imported here: ``moe_comm.handle`` checks handles with this package's wire helpers, and
the modes build handles, so importing the package must not pull in the modes."""
