"""Image encoders of the vision-language families on the paged path, and their preprocessing."""
