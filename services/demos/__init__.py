"""Demos that chain several stages (make train, make eval): the one place under services/ allowed to import more than one stage."""
