"""One merge from request to written folder: the checks that need no model, the matcher a method
names, the plain average, and the pipeline (resolve, align, measure, write, push)."""
