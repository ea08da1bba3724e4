from catalog_es.cli import main

main()
