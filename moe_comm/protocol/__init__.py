"""What every backend agrees on: the integer codes that travel between ranks (``codes``), the handles
and their checks (``handle``), the per-call agreement and its handshake (``agreement``,
``handshake``), routing digests (``digest``), shrink masks (``shrink``) and the low-latency send order
and receive layout (``low_latency_layout``). Backends import this package; it imports no backend."""
