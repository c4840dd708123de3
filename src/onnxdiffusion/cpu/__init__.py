"""What this CPU can do (ISA flags, the int8 kernel family) and the int8 graph lowerings chosen for it."""
