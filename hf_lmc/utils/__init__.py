"""Runtime helpers every stage may use: compute devices and launched processes, progress bars,
thread settings for linear algebra, glibc's malloc thresholds."""
