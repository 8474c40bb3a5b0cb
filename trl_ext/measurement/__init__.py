"""What a run measures: timers of each phase (``profiling``), each phase's work against the machine's floor
(``roofline``), and what a training log says (``observations``)."""
