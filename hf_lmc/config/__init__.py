"""Declarations, torch-free: every option (declared once), the flags generated from them, the
method registry, the recipe schema and the zoo's entries."""
