"""Engine backends behind one async interface (``workers.engine.base``)."""
