"""What the tests share and do not test: functions that run inside rank processes (``*_cases``),
fixtures' building blocks, scripts the tests start, and CPU models of vendor modules."""
