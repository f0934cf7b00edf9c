"""Seed topics and task templates of the demo's prompt set (``scripts/demo_prompts.py``).

Round 1 built the first training and held-out prompts; round 2 (``MORE_*``) adds new topics, roles,
concepts and templates for the second round of training prompts, so the heads see more varied replies.
"""

# ----------------------------------------------------------------------------------------- round 1
WRITING_FORMS = ["short story", "poem", "haiku", "limerick", "blog post", "product description", "speech",
                 "letter", "diary entry", "news headline and summary", "motivational message", "toast",
                 "short essay", "dialogue", "slogan", "review", "cover letter", "thank-you note", "tweet",
                 "birthday message"]
WRITING_TOPICS = ["autumn leaves", "a lost cat", "the first day of school", "a rainy city", "the ocean", "friendship",
                  "a robot learning to paint", "climate change", "a small bakery", "space travel", "a mountain hike",
                  "the importance of sleep", "a new smartphone", "a local library", "learning a language",
                  "a winter morning", "a grandmother's recipe", "electric cars", "a dragon who is afraid of fire",
                  "working from home", "a summer festival", "the moon", "a village by the sea", "coffee",
                  "a train journey", "recycling", "a chess tournament", "the internet", "gardening",
                  "a time traveler", "music", "a football match", "a lighthouse keeper", "volunteering",
                  "a forgotten key", "the city at night", "honeybees", "a birthday party", "a quiet forest",
                  "a job interview", "kindness", "a snowstorm", "the desert", "an old photograph", "bicycles"]
AUDIENCES = ["children", "a teenager", "my boss", "a close friend", "new employees", "customers", "my neighbours",
             "a teacher", "the city council", "my grandparents"]
EMAIL_SITUATIONS = ["asking for a day off", "apologising for a late reply", "inviting them to a meeting",
                    "complaining about a broken product", "thanking them for their help", "asking for feedback",
                    "announcing a new project", "requesting a refund", "introducing myself", "rescheduling an appointment"]

ROLES = ["a pirate captain", "a medieval knight", "a friendly librarian", "a travel guide in Rome", "a detective",
         "a chef in a busy restaurant", "a fitness coach", "a wise old wizard", "an astronaut on the ISS",
         "a museum tour guide", "a customer support agent", "a job interviewer", "a history teacher",
         "Sherlock Holmes", "a tour guide in Tokyo", "a park ranger", "a radio DJ", "a shopkeeper in a small town",
         "a robot butler", "a sports commentator", "a doctor", "a poet", "a startup founder", "a farmer",
         "a ship's navigator", "a jazz musician", "a kindergarten teacher", "a mountain guide", "a news reporter",
         "a famous painter", "a space alien visiting Earth", "a barista", "a lawyer", "a zookeeper",
         "a video game character", "a king giving a speech", "a gardener", "a taxi driver in London",
         "a marine biologist", "a stand-up comedian"]
ROLE_REQUESTS = ["Introduce yourself.", "Describe a typical day.", "Give me some advice.", "Tell me a short story.",
                 "What is the most important lesson you have learned?", "Welcome me and explain what you do.",
                 "Answer my question: what should I do first?", "Describe your favourite place.",
                 "What do you like most about your work?", "Tell me about the hardest day you remember."]

STEM_CONCEPTS = ["photosynthesis", "gravity", "the water cycle", "DNA", "black holes", "electricity", "magnetism",
                 "evolution", "the immune system", "climate change", "plate tectonics", "the speed of light",
                 "atoms", "chemical reactions", "vaccines", "the greenhouse effect", "machine learning",
                 "the internet", "binary numbers", "encryption", "renewable energy", "the human heart",
                 "the solar system", "earthquakes", "volcanoes", "friction", "sound waves", "rainbows",
                 "the periodic table", "bacteria and viruses", "nuclear energy", "the brain", "tides",
                 "compound interest", "probability", "a neural network", "an algorithm", "a CPU", "RAM",
                 "batteries", "antibiotics", "cells", "the ozone layer", "seasons", "inflation", "entropy",
                 "the Pythagorean theorem", "prime numbers", "fractions", "statistics", "GPS", "solar panels"]
STEM_PAIRS = [("a virus", "a bacterium"), ("weather", "climate"), ("speed", "velocity"), ("mass", "weight"),
              ("an atom", "a molecule"), ("AC", "DC current"), ("RAM", "storage"), ("a comet", "an asteroid"),
              ("mitosis", "meiosis"), ("heat", "temperature"), ("a list", "a tuple in Python"),
              ("HTTP", "HTTPS"), ("a planet", "a star"), ("an acid", "a base"), ("DNA", "RNA")]
HUMANITIES = ["the Roman Empire", "the French Revolution", "the Renaissance", "ancient Egypt", "World War I",
              "the Industrial Revolution", "the Cold War", "democracy", "the printing press", "the Silk Road",
              "Shakespeare", "Leonardo da Vinci", "Mahatma Gandhi", "Martin Luther King Jr.", "Marie Curie",
              "the Great Wall of China", "ancient Greece", "philosophy", "Socrates", "impressionism",
              "the Olympic Games", "the Maya civilisation", "the Vikings", "the United Nations", "human rights",
              "the invention of writing", "Buddhism", "Greek mythology", "the Beatles", "jazz", "architecture",
              "the moon landing", "the fall of the Berlin Wall", "Confucius", "the Magna Carta", "Napoleon",
              "the Byzantine Empire", "the Aztecs", "classical music", "Pride and Prejudice", "Don Quixote",
              "The Odyssey", "existentialism", "the Enlightenment", "globalisation", "urbanisation"]
EVERYDAY = ["sleep better", "save money", "learn a new language", "cook rice", "stay focused while studying",
            "start running", "reduce stress", "make new friends", "organise my desk", "prepare for a job interview",
            "keep houseplants alive", "eat healthier", "wake up earlier", "write a good CV", "plan a trip",
            "make a cup of tea", "clean a laptop keyboard", "learn to swim", "be more productive",
            "speak in public", "fix a flat bicycle tyre", "choose a good book", "drink more water",
            "start a small garden", "keep a budget", "stop procrastinating", "take better photos with my phone",
            "get along with my roommate", "prepare for an exam", "bake bread", "remember names",
            "learn to play the guitar", "spend less time on my phone", "pack a suitcase", "care for a puppy",
            "make a good first impression", "start meditating", "stay warm in winter", "host a dinner party"]
EVERYDAY_QUESTIONS = ["Why is the sky blue?", "How many hours should an adult sleep?", "What should I eat for breakfast?",
                      "Is coffee bad for you?", "How do I boil an egg?", "What is a good name for a cat?",
                      "How do airplanes stay in the air?", "What is the best way to learn maths?",
                      "Why do we dream?", "How do I tie a tie?", "What can I cook with potatoes and eggs?",
                      "How long should I walk every day?", "What is the capital of France?",
                      "What is the capital of Japan?", "How far is the Moon from Earth?",
                      "Which is the largest ocean?", "Who wrote Romeo and Juliet?", "How many continents are there?",
                      "What is the tallest mountain in the world?", "How does a refrigerator work?"]

CODING_TASKS = ["reverses a string", "checks whether a string is a palindrome", "returns the n-th Fibonacci number",
                "counts the vowels in a string", "finds the largest number in a list", "removes duplicates from a list",
                "sorts a list of dictionaries by a key", "checks whether a number is prime", "computes a factorial",
                "merges two sorted lists", "flattens a nested list", "counts word frequencies in a text",
                "converts Celsius to Fahrenheit", "reads a CSV file and prints each row",
                "returns the sum of the squares of a list", "finds the second largest number in a list",
                "capitalises every word in a sentence", "checks whether two strings are anagrams",
                "computes the average of a list of numbers", "generates a random password",
                "returns the greatest common divisor of two numbers", "validates an email address with a regex",
                "counts the lines in a file", "implements binary search", "implements bubble sort",
                "transposes a matrix", "groups words by their first letter", "returns the intersection of two lists",
                "converts a Roman numeral to an integer", "checks if brackets in a string are balanced",
                "chunks a list into pieces of size n", "computes the median of a list", "rotates a list by k steps",
                "returns all even numbers from a list", "parses a date string", "implements a stack class",
                "implements a simple queue", "computes the dot product of two vectors", "finds all primes below n",
                "writes a dictionary to a JSON file"]
CODING_LANGS = ["Python", "JavaScript", "Bash", "SQL", "C", "Java", "Rust", "Go"]
CODING_HOWTO = ["read a file line by line", "make an HTTP request", "sort a list", "handle exceptions",
                "write a for loop", "define a class", "use a dictionary", "join strings", "get the current date",
                "create a virtual environment", "write a unit test", "iterate over two lists at once",
                "remove whitespace from a string", "convert a string to an integer", "format a number with two decimals",
                "list the files in a folder", "count occurrences in a list", "reverse a list", "copy a file"]
CODE_SNIPPETS = ["def f(xs):\n    return [x * x for x in xs if x % 2 == 0]",
                 "for i in range(1, 11):\n    print(i, i ** 2)",
                 "s = 'hello world'\nprint(s[::-1].upper())",
                 "import collections\nc = collections.Counter('mississippi')\nprint(c.most_common(2))",
                 "def g(n):\n    return n if n < 2 else g(n - 1) + g(n - 2)",
                 "nums = [3, 1, 2]\nnums.sort(reverse=True)\nprint(nums)",
                 "with open('data.txt') as f:\n    total = sum(int(line) for line in f)",
                 "SELECT name, COUNT(*) FROM orders GROUP BY name ORDER BY 2 DESC;",
                 "x = {k: v for k, v in zip('abc', range(3))}",
                 "while n > 0:\n    n //= 2\n    steps += 1"]

NAMES = ["Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Hassan", "Ines", "Jamal", "Kenji", "Lena",
         "Maria", "Noah", "Olivia", "Pablo", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Wei", "Yara", "Zoe"]
ITEMS = ["apples", "pencils", "books", "cupcakes", "marbles", "stickers", "oranges", "cookies", "tickets", "coins"]
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Dublin", "Oslo", "Athens", "Cairo",
          "Tokyo", "Seoul", "Lima", "Toronto", "Nairobi", "Sydney", "Mumbai", "Mexico City", "Istanbul"]

FOLLOWUPS = ["Can you make it shorter?", "Can you explain that more simply?", "Give me one more example.",
             "Can you put that in a bulleted list?", "Why is that?", "Can you summarise that in one sentence?",
             "What would you add to that?", "Can you make it more formal?", "Thanks! Can you give me a tip to remember it?",
             "How would you explain it to a ten-year-old?", "What is the most important point?",
             "Can you write it again with a happier tone?", "Is there anything I should be careful about?"]


PYTHON_MODULES = ["string", "json", "math", "random", "collections", "itertools", "functools", "os.path", "re",
                  "datetime", "statistics", "textwrap", "pathlib", "shutil", "csv", "heapq", "bisect", "fractions",
                  "decimal", "calendar", "time", "copy", "operator", "difflib", "base64", "hashlib", "uuid", "zipfile"]

# ----------------------------------------------------------------------------------------- round 2
MORE_WRITING_TOPICS = ["a city park in spring", "a retired teacher", "the smell of rain", "a missed bus",
                       "a new neighbour", "an old bookshop", "the last day of summer", "a family road trip",
                       "a power cut", "a street musician", "a school science fair", "a broken umbrella",
                       "a hospital night shift", "a wedding", "moving to a new country", "a fishing trip",
                       "a mysterious letter", "the first snow", "a marathon", "a kitchen disaster",
                       "a museum at night", "an island", "a childhood friend", "a farmers' market",
                       "a thunderstorm", "a penguin colony", "a startup's first customer", "an empty stadium",
                       "a kite", "a lost wallet", "learning to drive", "a surprise visit", "a hot air balloon",
                       "a garden in autumn", "a late-night diner", "a tree that is a hundred years old",
                       "a cat who runs a shop", "a train station at dawn", "a school reunion", "a volcano"]
MORE_WRITING_TASKS = ["Write a {form} about {topic} for {audience}.", "Write a funny {form} about {topic}.",
                      "Write a sad {form} about {topic}.", "Write a {form} about {topic} in exactly five sentences.",
                      "Write the opening paragraph of a {form} about {topic}."]
MORE_ROLES = ["a ship's cook", "a lighthouse keeper", "a time traveller from 1900", "a wizard's apprentice",
              "a tennis coach", "a flight attendant", "a bookshop owner", "a firefighter", "a nurse",
              "an archaeologist", "a librarian on the Moon", "a baker in Paris", "a science teacher",
              "a mountain climber", "a cat who can talk", "a dragon", "a tour guide in Cairo", "a game show host",
              "a film director", "a personal trainer", "a car mechanic", "a beekeeper", "a pilot",
              "a pirate parrot", "a hotel receptionist", "a museum guard", "a weather forecaster",
              "a travel blogger", "an inventor", "a philosopher in ancient Athens"]
MORE_ROLE_REQUESTS = ["What is your biggest challenge?", "Explain your job to a child.",
                      "Give me three rules you live by.", "What would you tell someone who wants your job?",
                      "Describe the strangest thing that ever happened to you.", "What are you doing right now?",
                      "Recommend something to me.", "Tell me a joke from your world.",
                      "How did you start doing what you do?", "What does your ideal weekend look like?"]
MORE_STEM_CONCEPTS = ["the Big Bang", "quantum computing", "photosynthesis in the ocean", "the nitrogen cycle",
                      "an electric motor", "a transistor", "the human eye", "digestion", "hurricanes",
                      "genetic engineering", "blood types", "the Doppler effect", "osmosis", "a rocket engine",
                      "the metric system", "a compiler", "an operating system", "a database", "cloud computing",
                      "a blockchain", "Wi-Fi", "a search engine", "3D printing", "superconductors", "glaciers",
                      "coral reefs", "the carbon cycle", "pH", "the law of supply and demand", "exponential growth",
                      "logarithms", "the scientific method", "a hypothesis", "sleep cycles", "muscles",
                      "the lungs", "the Northern Lights", "Newton's laws of motion", "density", "lightning"]
MORE_STEM_TASKS = ["What are the main parts of {c}?", "What is a common misconception about {c}?",
                   "How is {c} used in everyday life?", "Write a short quiz with three questions about {c}.",
                   "Summarise {c} in two sentences.", "What would happen without {c}?",
                   "Who discovered or invented {c}?", "Explain {c} with an analogy."]
MORE_HUMANITIES = ["the Ottoman Empire", "the Inca Empire", "the Reformation", "the American Revolution",
                   "the Meiji Restoration", "ancient Rome's roads", "the Black Death", "the Mongol Empire",
                   "the Harlem Renaissance", "the Bauhaus", "Frida Kahlo", "Nelson Mandela", "Cleopatra",
                   "Albert Einstein's life", "the Suffragettes", "the invention of the telephone", "Stoicism",
                   "Hamlet", "Leo Tolstoy", "the Parthenon", "cave paintings", "the Cuban Missile Crisis",
                   "the European Union", "the Hanseatic League", "ancient Mesopotamia", "opera",
                   "the history of money", "the Space Race", "Charles Darwin", "the Taj Mahal"]
MORE_HUMANITIES_TASKS = ["What caused {c}?", "Who were the key people in {c}?", "Describe {c} for a school report.",
                         "What is the legacy of {c}?", "Explain {c} in three bullet points.",
                         "What is a common myth about {c}?"]
MORE_EVERYDAY = ["clean my oven", "learn to cook pasta", "stay motivated at the gym", "write a thank-you card",
                 "improve my handwriting", "sleep on a long flight", "set up a home office", "save for a holiday",
                 "negotiate a salary", "reduce food waste", "read more books", "make a smoothie",
                 "teach my dog to sit", "iron a shirt", "choose a laptop", "start journaling",
                 "get better at chess", "plan a birthday party", "keep my phone battery healthy",
                 "learn to touch type", "calm down before an exam", "make a simple budget spreadsheet",
                 "grow tomatoes on a balcony", "remove a coffee stain", "apologise to a friend",
                 "use less plastic", "learn to draw", "stretch after running", "organise my email inbox",
                 "prepare for a long hike"]
MORE_EVERYDAY_TASKS = ["How do I {g}?", "What mistakes should I avoid when I try to {g}?",
                       "Make a step-by-step plan to {g}.", "I have ten minutes a day. How can I {g}?",
                       "Explain to a beginner how to {g}."]
MORE_CODING_TASKS = ["counts the digits of a number", "checks whether a year is a leap year",
                     "converts a number to binary", "finds the longest word in a sentence",
                     "removes all punctuation from a string", "returns the k most common words in a text",
                     "checks whether a list is sorted", "computes the power set of a list", "implements a linked list",
                     "swaps the keys and values of a dictionary", "computes the Levenshtein distance",
                     "converts snake_case to camelCase", "generates the first n prime numbers",
                     "finds the missing number in a list from 1 to n", "validates a phone number",
                     "computes a running total of a list", "splits a list into even and odd numbers",
                     "computes the area of a circle", "converts a list of pairs to a dictionary",
                     "counts the words in a file", "checks whether a number is a perfect square",
                     "returns the unique characters of a string", "implements insertion sort",
                     "implements a binary tree", "merges two dictionaries", "finds duplicate files by size",
                     "reads a JSON file and prints its keys", "computes the mode of a list",
                     "formats seconds as hours, minutes and seconds", "pads a string to a fixed width"]
MORE_CODING_TEMPLATES = ["Write a Python function that {t}.", "Write a {lang} function that {t}.",
                         "Write a Python function that {t}, and explain its time complexity.",
                         "Write a Python function that {t}. Include two test cases."]
MORE_CODING_HOWTO = ["parse command-line arguments", "work with dates and times", "write to a CSV file",
                     "use a set", "sort a dictionary by value", "read environment variables",
                     "measure how long code takes", "download a web page", "use regular expressions",
                     "write a recursive function", "split a string", "check if a file exists",
                     "round a number", "generate random numbers", "use a while loop",
                     "create a list comprehension", "debug a program", "use a lambda function",
                     "handle a missing dictionary key", "write a docstring"]
MORE_PYTHON_MODULES = ["array", "enum", "dataclasses", "typing", "contextlib", "glob", "fnmatch", "tempfile",
                       "gzip", "io", "pprint", "reprlib", "locale", "secrets", "hmac", "html", "urllib.parse",
                       "email.utils", "sqlite3", "logging", "argparse", "unicodedata", "struct", "codecs", "zlib",
                       "string", "math", "itertools", "os", "sys", "shlex", "platform", "cmath", "numbers",
                       "graphlib", "colorsys", "wave", "mimetypes", "ipaddress", "timeit"]
