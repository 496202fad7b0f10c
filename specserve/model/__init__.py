"""The model: loading a checkpoint, our Llama runner and its compiled steps, and the backends the services drive."""
