"""The evaluation stages' work, one module per DVC stage: embed, baselines, knn, linear.

Each stage function takes typed keyword arguments, reads its inputs, writes its outputs
atomically and returns the metrics it wrote (numeric leaves only). The DVC stage scripts call
exactly one of them.

Labels: the number of classes is the manifest's ``class_names``; a label outside ``0..C-1`` is
refused, naming the value, and rows labelled -1 (unlabelled) are ignored with a logged count
(the rule of :mod:`pipeline.evaluate.metrics`).
"""
