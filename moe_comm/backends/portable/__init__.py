"""The portable backend (``backend.PortableBackend``): the normal and low-latency modes built from the
call agreement (``moe_comm.protocol``) and a byte mover (``moe_comm.transport``), over any transport.
It is the semantic reference: every other backend's outputs equal its bits.

Nothing is imported here, so that importing one mode does not pull in the others."""
