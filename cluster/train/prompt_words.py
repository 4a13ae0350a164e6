"""Word lists the training prompts are built from: everyday topics, chat and list
templates, coding tasks and follow-up turns. Plain data, no logic (see prompts.py)."""

from __future__ import annotations

TOPICS = (
    "the ocean", "volcanoes", "bread", "the moon", "bicycles", "rainforests", "jazz",
    "chess", "honey bees", "glaciers", "the printing press", "coffee", "tea", "gardening",
    "photosynthesis", "the solar system", "electric cars", "recycling", "dinosaurs",
    "the Roman Empire", "pyramids", "the human heart", "sleep", "exercise",
    "healthy eating", "friendship", "time management", "learning a language",
    "music theory", "painting", "photography", "the internet", "computers", "robots",
    "rain", "snow", "deserts", "mountains", "rivers", "birds", "cats", "dogs", "whales",
    "butterflies", "trees", "flowers", "the weather", "clouds", "earthquakes",
    "the stock market", "saving money", "cooking pasta", "baking a cake", "camping",
    "hiking", "swimming", "football", "the Olympics", "libraries", "museums", "trains",
    "airplanes", "bridges", "lighthouses", "castles", "pirates", "space travel",
    "telescopes", "microscopes", "vaccines", "bacteria", "the water cycle", "wind energy",
    "solar power", "batteries", "magnets", "gravity", "light", "sound", "colours",
    "numbers", "prime numbers", "geometry", "fractions", "maps", "compasses", "clocks",
    "calendars", "holidays", "birthdays", "writing a letter", "job interviews",
    "public speaking", "meditation", "yoga",
    # added for the larger prompt set
    "the Great Wall of China", "ancient Egypt", "the Renaissance", "the Industrial Revolution",
    "democracy", "taxes", "inflation", "credit cards", "budgeting", "renting an apartment",
    "buying a used car", "moving to a new city", "starting a small business", "marketing",
    "customer service", "remote work", "team meetings", "writing an essay", "reading books",
    "poetry", "novels", "theatre", "film making", "video games", "board games", "puzzles",
    "origami", "knitting", "woodworking", "pottery", "playing the guitar", "the piano",
    "singing", "dancing", "running a marathon", "cycling to work", "tennis", "basketball",
    "skiing", "surfing", "rock climbing", "fishing", "bird watching", "astronomy",
    "black holes", "stars", "comets", "Mars", "Jupiter", "the Sun", "eclipses", "tides",
    "coral reefs", "sharks", "octopuses", "penguins", "elephants", "lions", "horses",
    "wolves", "ants", "spiders", "frogs", "snakes", "mushrooms", "seeds", "soil",
    "composting", "farming", "irrigation", "wheat", "rice", "chocolate", "cheese",
    "vegetables", "fruit", "vitamins", "drinking water", "the immune system", "the brain",
    "memory", "emotions", "habits", "motivation", "stress", "happiness", "kindness",
    "parenting", "teaching", "homework", "exams", "university", "scholarships",
    "volunteering", "charity", "climate change", "air pollution", "plastic waste",
    "forests", "national parks", "endangered species", "electricity", "the light bulb",
    "the telephone", "radio", "television", "smartphones", "social media", "email etiquette",
    "passwords", "online privacy", "spreadsheets", "databases", "programming",
    "algorithms", "sorting", "binary numbers", "encryption", "artificial intelligence",
    "machine learning", "3D printing", "drones", "satellites", "GPS", "rockets",
    "submarines", "ships", "cars", "traffic", "cities", "villages", "architecture",
    "skyscrapers", "houses", "furniture", "cleaning a kitchen", "doing laundry",
    "packing for a trip", "travelling abroad", "hotels", "airports", "passports",
    "languages of the world", "writing systems", "mathematics", "statistics",
    "probability", "percentages", "algebra", "triangles", "circles", "measuring",
    "the metric system", "temperature", "fire", "ice", "water", "air", "oxygen",
    "carbon", "atoms", "chemistry", "physics", "biology", "evolution", "genetics", "DNA",
    "cells", "plants", "animals", "ecosystems", "weather forecasts", "hurricanes",
    "tornadoes", "floods", "droughts", "first aid", "hospitals", "doctors", "nurses",
    "dentists", "firefighters", "police", "post offices", "newspapers", "journalism",
    "history", "archaeology", "myths", "fairy tales", "dragons", "superheroes",
    "detectives", "mysteries", "kites", "balloons", "fireworks", "music festivals",
    "weddings", "gifts", "manners", "apologising", "negotiation", "leadership",
    "decision making", "creativity", "curiosity", "patience", "honesty",
)  # fmt: skip

CHAT_TEMPLATES = (
    "What is {t}?",
    "Tell me three interesting facts about {t}.",
    "Explain {t} to a ten-year-old.",
    "Write a short poem about {t}.",
    "Give me some tips about {t}.",
    "Why is {t} important?",
    "Write a short story that involves {t}.",
    "What are the pros and cons of {t}?",
    "Describe {t} in a few sentences.",
    "How would you teach someone about {t}?",
    # lists, explanations, rewriting
    "List five things everyone should know about {t}.",
    "Make a numbered list of common mistakes people make with {t}.",
    "Give me a step-by-step beginner's guide to {t}.",
    "Write a short blog post introduction about {t}.",
    "What are some common myths about {t}?",
    "Write a haiku about {t}.",
    "Explain {t} in exactly three bullet points.",
    "Write a friendly email to a friend about {t}.",
    "Write a quiz with three questions about {t}, with answers.",
    "What questions would a child ask about {t}? Answer two of them.",
    "Summarize the history of {t} briefly.",
    "Write a product description for a book about {t}.",
)

PAIR_TEMPLATES = (
    "Compare {a} and {b}.",
    "What do {a} and {b} have in common?",
    "Write a short story that involves {a} and {b}.",
    "Which is more interesting, {a} or {b}? Explain your answer.",
)

TEXT_TEMPLATES = (
    "Summarize this in one sentence: {x}",
    "Explain this to a beginner: {x}",
    "Rewrite this more simply: {x}",
    "What is the main idea of the following text? {x}",
    "Write a question that this text answers: {x}",
    "Turn the following text into a bulleted list of key points:\n\n{x}",
    "Read the text and answer: what is it about, and who would need it?\n\n{x}",
    "Rewrite this text in a friendly, informal tone:\n\n{x}",
    "Give an example that illustrates the following:\n\n{x}",
)

MODULE_TEMPLATES = (
    "What is the Python module {m} used for?",
    "Give an example of using the {m} module in Python.",
    "When should I use Python's {m} module?",
)

DOC_TEMPLATES = (
    "Explain what {name} in Python's {module} module does, based on its documentation:\n\n{doc}",
    "Here is the docstring of {name} from the {module} module:\n\n{doc}\n\nShow how to use it.",
    "In Python, what is {module}.{name} for?",
)

CODE_TEMPLATES = (
    "Explain what this Python function does:\n\n```python\n{code}\n```",
    "Write a docstring for this function:\n\n```python\n{code}\n```",
    "Add type hints to this Python function:\n\n```python\n{code}\n```",
    "Rewrite this function so that it is easier to read:\n\n```python\n{code}\n```",
    "Write a unit test for this function:\n\n```python\n{code}\n```",
    "What could go wrong with this code?\n\n```python\n{code}\n```",
)

CODING_TASKS = (
    "reverses a string", "checks whether a number is prime", "counts the vowels in a string",
    "returns the largest element of a list", "computes the factorial of a number",
    "merges two sorted lists", "removes duplicates from a list while keeping order",
    "reads a CSV file and prints each row", "checks whether a word is a palindrome",
    "returns the n-th Fibonacci number", "flattens a nested list", "counts word frequencies",
    "converts Celsius to Fahrenheit", "finds the second largest number in a list",
    "sorts a list of dictionaries by a key", "validates an email address",
    "computes the average of a list of numbers", "generates a random password",
    "checks whether two strings are anagrams", "finds the greatest common divisor",
    "transposes a matrix", "groups a list of words by their first letter",
    "returns all the primes below n", "computes the median of a list",
    "capitalizes the first letter of every word", "splits a list into chunks of size n",
    "binary-searches a sorted list", "counts the lines in a text file",
    "finds the longest word in a sentence", "converts a number to binary",
    "checks whether brackets in a string are balanced", "rotates a list by k positions",
    "implements a simple stack class", "implements a queue with two stacks",
    "parses a date string", "computes compound interest", "removes punctuation from text",
    "finds common elements of two lists", "returns the digits of an integer",
    "implements bubble sort", "implements insertion sort", "implements quicksort",
    "writes a dictionary to a JSON file", "downloads nothing but simulates a retry loop",
    "times how long another function takes", "caches the results of a slow function",
    "counts how often each character appears", "converts a list of pairs into a dict",
    "checks whether a year is a leap year", "formats a number with thousands separators",
)  # fmt: skip

CODING_TEMPLATES = (
    "Write a Python function that {task}.",
    "Write a Python function that {task}, and explain how it works.",
    "How do I write code that {task} in Python? Keep it short.",
    "Write a Python function that {task}. Include a docstring and an example.",
)

FOLLOW_UPS = (
    "Can you make that shorter?",
    "Thanks! Can you give me an example?",
    "Can you explain that in simpler words?",
    "Please turn that into a bulleted list.",
    "What is the most important point there?",
    "Can you tell me more?",
    "Could you rewrite that in a more formal tone?",
    "Why is that?",
)
