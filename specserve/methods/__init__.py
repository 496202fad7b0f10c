"""The speculation methods, one module each, and registry.py: the one list of their names
and what each needs. docs/design.md, "Methods", says how to add one."""
