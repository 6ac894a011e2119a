"""Stage 3: the inputs each layer is probed with: stratified synthetic rows and captured real
activations."""
