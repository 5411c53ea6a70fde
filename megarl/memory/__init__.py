"""Device memory: the plan that checks a layout fits before anything is built, and offloading models' state
between device and host."""
