"""Background loops on the core: the breach record, the tree statistics, the periodic runner,
and the duty clock that says what each loop's work costs."""
