"""The parts of ``scripts/serve.py``: the request edge (``edge``), image decoding (``decode``), the LitAPI (``api``)."""
