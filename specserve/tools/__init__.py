"""Commands that measure, train or test the service rather than serve: bench, load, fuzz, traces,
the demo pair's training and evaluation, test models."""
